"""Sending a run's tokens to an HTTP client: SSE events as they arrive, or one collected
response; and cancelling the work when the client disconnects first."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass
from typing import TypeVar

from starlette.requests import Request

from engine.stop import StopReason
from pdserve import wire
from pdserve.v1 import generation_pb2 as pb
from router.errors import RouterError, status_of
from router.gateway import Run
from router.http_api.openai_format import SSE_DONE, Responder, error_json, sse, usage_json

log = logging.getLogger(__name__)
T = TypeVar("T")


class ClientGone(Exception):
    """The HTTP client disconnected before its response was ready."""


async def until_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Runs work, cancelling it if the client disconnects first (Starlette only watches for
    disconnects once a streaming response has started)."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)  # let its cleanup run
    if task.cancelled():
        raise ClientGone()
    return task.result()


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def sse_events(
    run: Run, responder: Responder, include_usage: bool, continuous_usage: bool = False,
    echo: str = "",
) -> AsyncIterator[bytes]:  # fmt: skip
    """One event per message with text or a finish reason; the run is closed however the
    stream ends (Starlette cancels it when the client disconnects). echo: text sent before
    the completion's own; continuous_usage: vLLM's usage so far in every chunk."""
    try:
        if responder.kind == "chat":
            yield sse(responder.chunk("", None, first=True))
        if echo:
            yield sse(responder.chunk(echo, None))
        usage = pb.Usage()
        pending: list[pb.TokenLogprobs] = []  # tokens whose text is held back (stop strings)
        async for message in run.messages():
            if message.HasField("usage"):
                usage = message.usage
            pending.extend(message.logprobs)
            if message.text or message.finish_reason:
                stop_reason = wire.stop_reason_of(message)
                logprobs = None if responder.logprobs is None else responder.logprobs.json(pending)
                pending = []
                chunk = responder.chunk(
                    message.text, message.finish_reason or None, stop_reason, logprobs=logprobs
                )
                if continuous_usage:
                    chunk["usage"] = usage_json(_usage_so_far(run, message))
                yield sse(chunk)
        if include_usage:
            yield sse(responder.usage_chunk(usage))
        yield SSE_DONE
    except RouterError as e:  # the 200 status line is sent already: report it in-band
        log.warning("stream %s failed: %s", run.job.ticket.request_id, e)
        yield sse(error_json(e, status_of(e)))
    finally:
        run.close()


def _usage_so_far(run: Run, message: pb.GenerateResponse) -> pb.Usage:
    if message.HasField("usage"):  # the last message's: with the cached prompt tokens
        return message.usage
    num_prompt = run.job.ticket.num_prompt_tokens
    return pb.Usage(prompt_tokens=num_prompt, completion_tokens=len(run.output_token_ids))


@dataclass(frozen=True, slots=True)
class Completion:
    text: str
    finish_reason: str
    stop_reason: StopReason
    usage: pb.Usage
    logprobs: list[pb.TokenLogprobs]  # one per token, when the request asks


async def collect(run: Run) -> Completion:
    """The whole completion."""
    pieces: list[str] = []
    logprobs: list[pb.TokenLogprobs] = []
    finish_reason, stop_reason, usage = "", None, pb.Usage()
    async for message in run.messages():
        pieces.append(message.text)
        logprobs.extend(message.logprobs)
        finish_reason = message.finish_reason or finish_reason
        stop_reason = wire.stop_reason_of(message)  # the last message's
        if message.HasField("usage"):
            usage = message.usage
    return Completion("".join(pieces), finish_reason, stop_reason, usage, logprobs)
