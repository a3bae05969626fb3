"""Sending a run's tokens to an HTTP client: SSE events as they arrive, or one collected
response; and cancelling the work when the client disconnects first."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable
from typing import TypeVar

from starlette.requests import Request

from pdserve import grpc_convert
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
    """One event per message with text or a finish reason, for the choice (sample) it is
    from; the run is closed however the stream ends (Starlette cancels it when the client
    disconnects). echo: text sent before each choice's own; continuous_usage: vLLM's usage
    so far in every chunk."""
    try:
        num_choices = run.job.params.n
        for index in range(num_choices):
            if responder.kind == "chat":
                yield sse(responder.chunk("", None, index=index, first=True))
            if echo:
                yield sse(responder.chunk(echo, None, index=index))
        usage = pb.Usage()
        # Per choice: tokens whose text is held back (stop strings).
        pending: list[list[pb.TokenLogprobs]] = [[] for _ in range(num_choices)]
        async for message in run.messages():
            if message.HasField("usage"):
                usage = message.usage
            index = message.index
            pending[index].extend(message.logprobs)
            if message.text or message.finish_reason:
                stop_reason = grpc_convert.stop_reason_of(message)
                logprobs = None
                if responder.logprobs:
                    logprobs = responder.logprobs[index].json(pending[index])
                pending[index] = []
                chunk = responder.chunk(
                    message.text, message.finish_reason or None, stop_reason, index=index,
                    logprobs=logprobs,
                )  # fmt: skip
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
