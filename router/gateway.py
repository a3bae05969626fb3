"""The request path both APIs share: tokenize once, check the limits, admit, call the chosen
decode worker (naming the chosen prefill worker) under the request's deadline, and stream its
messages back, moving the request to another decode worker if its worker is lost."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, replace
from typing import Any

import grpc

from engine import SamplingParams
from engine import errors as engine_errors
from engine.chat_template import ChatTemplate, ChatTemplateError
from engine.prefix_hash import PromptBlockHashes
from engine.tokenizer import TextTokenizer
from pdserve import grpc_convert
from pdserve.v1 import generation_pb2 as pb
from pdserve.worker.v1 import worker_pb2 as wpb
from router import metrics
from router.admission import Admission, Lease
from router.errors import (
    DeadlineExceededError,
    InvalidRequestError,
    OverloadedError,
    PromptTooLongError,
    RouterError,
    UnavailableError,
    WorkerLostError,
)
from router.migration import ResumedText
from router.settings import RouterSettings
from router.ticket import Ticket, affinity_key, kv_blocks_held
from router.upstream import DecodeClient, error_of
from router.workers import WorkerPool

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Whole:
    """A run's messages gathered: each sample's whole response, by index, and the request's
    usage (every sample's tokens) and time to first token."""

    samples: list[pb.GenerateResponse]
    usage: pb.Usage
    ttft: pb.TtftBreakdown | None  # None when no token came


@dataclass(frozen=True, slots=True)
class Job:
    ticket: Ticket
    prompt_token_ids: list[int]
    params: SamplingParams
    received_s: float  # monotonic: the request reached the router
    tokenize_s: float
    deadline_s: float  # monotonic: past it the request ends with DeadlineExceededError

    def remaining_s(self, doing: str) -> float:
        remaining_s = self.deadline_s - time.monotonic()
        if remaining_s <= 0:
            raise DeadlineExceededError(f"the request's deadline passed {doing}")
        return remaining_s


def excluding(ticket: Ticket, worker_id: str, pool: WorkerPool) -> frozenset[str] | None:
    """The decode workers a request moving on from worker_id must avoid: each it was lost on
    or refused by, so a refusal is tried once per decode worker. None when no registered
    decode-side worker is left to try."""
    excluded = ticket.excluded_decode_ids | {worker_id}
    decoders = pool.infos("decode") + pool.infos("aggregated")
    if all(w.worker_id in excluded for w in decoders):
        return None
    return excluded


class Gateway:
    def __init__(
        self, settings: RouterSettings, tokenizer: TextTokenizer, pool: WorkerPool,
        admission: Admission, decode: DecodeClient,
    ) -> None:  # fmt: skip
        self.settings = settings
        self.tokenizer = tokenizer
        self.pool = pool
        self.admission = admission
        self.decode = decode

    def max_model_len(self) -> int:
        """The smallest context among registered workers (every request must fit anywhere)."""
        if self.pool.max_model_len is None:
            raise UnavailableError("no worker is registered; retry when one is up")
        return self.pool.max_model_len

    def chat_template(self) -> ChatTemplate:
        try:
            return self.tokenizer.chat()
        except ChatTemplateError as e:
            raise InvalidRequestError(str(e), param="messages") from e

    async def render_chat(
        self, template: ChatTemplate, messages: list[dict[str, Any]], **options: Any
    ) -> str:
        """options: ChatTemplate.render's."""
        try:
            return await asyncio.to_thread(template.render, messages, **options)
        except ChatTemplateError as e:
            raise InvalidRequestError(str(e), param="messages") from e

    def token_text(self, token_id: int) -> str:
        """One token's text in logprobs: special tokens shown, as vLLM shows them."""
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    async def tokenize(
        self, text: str, param: str = "prompt", add_special_tokens: bool = True
    ) -> list[int]:
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:  # lone surrogates from JSON escapes
            raise InvalidRequestError(
                f"{param} is not valid Unicode: {e.reason}", param=param
            ) from e
        return await asyncio.to_thread(self.tokenizer.encode, text, add_special_tokens)

    def job(
        self, prompt_token_ids: list[int], make_params: Callable[[int], SamplingParams],
        received_s: float, param: str = "prompt", client_timeout_s: float | None = None,
    ) -> Job:  # fmt: skip
        """Checks the limits. make_params gets the context room left after the prompt (the
        chat API's default max_tokens). The deadline: the request timeout, or the client's own
        (a gRPC deadline) when that is sooner."""
        num_prompt = len(prompt_token_ids)
        if num_prompt == 0:
            raise InvalidRequestError(f"{param} is empty", param=param)
        context = self.max_model_len()
        max_prompt = min(self.settings.max_prompt_tokens or context - 1, context - 1)
        if num_prompt > max_prompt:
            raise PromptTooLongError(
                f"{param} has {num_prompt} tokens; this server takes at most {max_prompt}", param
            )
        try:
            params = make_params(context - num_prompt)
        except engine_errors.InvalidRequestError as e:
            raise InvalidRequestError(str(e)) from e
        if num_prompt + params.max_tokens > context:
            raise PromptTooLongError(
                f"this model's maximum context length is {context} tokens, but {num_prompt} "
                f"prompt tokens + max_tokens {params.max_tokens} would need "
                f"{num_prompt + params.max_tokens}", "max_tokens",
            )  # fmt: skip
        arrival_s = time.monotonic()
        ticket = self.ticket(
            uuid.uuid4().hex, prompt_token_ids, params.max_tokens, arrival_s, num_seqs=params.n
        )
        timeout_s = self.settings.request_timeout_s
        if client_timeout_s is not None:
            timeout_s = min(timeout_s, client_timeout_s)
        tokenize_s = ticket.arrival_s - received_s
        return Job(ticket, prompt_token_ids, params, received_s, tokenize_s, received_s + timeout_s)

    def ticket(
        self, request_id: str, prompt_token_ids: list[int], max_tokens: int, arrival_s: float,
        excluded_decode_ids: frozenset[str] = frozenset(), num_seqs: int = 1,
    ) -> Ticket:  # fmt: skip
        admission = self.settings.admission
        num_prompt = len(prompt_token_ids)
        num_reserved = min(max_tokens, admission.kv_output_reserve_tokens)
        block_size = self.pool.block_size
        return Ticket(
            request_id=request_id,
            num_prompt_tokens=num_prompt,
            max_tokens=max_tokens,
            num_kv_blocks=kv_blocks_held(num_prompt, num_reserved, block_size, num_seqs),
            bucket=admission.buckets.of(num_prompt),
            arrival_s=arrival_s,
            affinity_key=affinity_key(prompt_token_ids),
            block_size=block_size,
            excluded_decode_ids=excluded_decode_ids,
            block_hashes=PromptBlockHashes(prompt_token_ids, block_size),
            num_seqs=num_seqs,
        )

    async def open(self, job: Job) -> Run:
        """Admits the job and starts it; returns once the first message is in (so an early
        error can still become a proper status), or raises a RouterError."""
        run = Run(self, job)
        try:
            await run.start()
        except BaseException:
            run.close()
            raise
        return run


class Run:
    """One admitted request in flight: the decode worker's messages, observed on the way.

    A request whose decode worker is lost (connection gone, stream cut short, request aborted)
    before it finished moves to another decode worker, up to settings.max_migrations times,
    with the tokens streamed so far appended to its prompt: the client's stream goes on.
    """

    def __init__(self, gateway: Gateway, job: Job) -> None:
        self.gateway = gateway
        self.job = job
        self.ticket = job.ticket  # the current leg's: a moved request gets a new one
        self.lease: Lease | None = None
        self.call: grpc.aio.UnaryStreamCall | None = None
        self.first: pb.GenerateResponse | None = None
        self.output_token_ids: list[int] = []  # every token the client was sent
        self.num_sent_chars = 0  # and the characters of text
        self.num_migrations = 0
        self._resumed: ResumedText | None = None  # the router's own text, once moved
        self._last_token_s: float | None = None
        self._leg_has_token = False
        self._num_open = job.params.n  # samples without their finish reason yet
        # The time to first token admission predicted when the request arrived (its first
        # leg's: a refused or moved leg's own prediction starts later than the client's wait).
        self.predicted_ttft_s: float | None = None

    async def start(self) -> None:
        await self._dispatch()
        self.first = await self._next()

    async def messages(self) -> AsyncIterator[pb.GenerateResponse]:
        """Every message, the first included, up to the last sample's finish reason."""
        assert self.first is not None, "start() first"
        message = self.first
        while True:
            yield message
            if self._num_open == 0:
                return
            message = await self._next()

    async def gather(self) -> Whole:
        """Every message, into each sample's whole response (a response not streamed)."""
        samples = [pb.GenerateResponse(index=i) for i in range(self.job.params.n)]
        usage, ttft = pb.Usage(), None
        async for message in self.messages():
            whole = samples[message.index]
            whole.token_ids.extend(message.token_ids)
            whole.logprobs.extend(message.logprobs)
            whole.text += message.text
            whole.finish_reason = message.finish_reason
            grpc_convert.set_stop_reason(whole, grpc_convert.stop_reason_of(message))
            if message.HasField("ttft"):
                ttft = message.ttft
            if message.HasField("usage"):
                usage = message.usage
        return Whole(samples, usage, ttft)

    def close(self) -> None:
        """Synchronous on purpose: it runs in `finally` blocks of cancelled tasks."""
        if self.call is not None:
            self.call.cancel()  # no-op once the call has ended; aborts the request otherwise
        if self.lease is not None:
            self.lease.end()

    async def _dispatch(self) -> None:
        """Admits the current leg and calls its decode worker with what is left of the
        deadline (the worker spends no more on prefill and KV landing)."""
        gateway, job, ticket = self.gateway, self.job, self.ticket
        try:
            async with asyncio.timeout(job.remaining_s("before the request was admitted")):
                self.lease = await gateway.admission.admit(ticket)
        except TimeoutError:
            raise DeadlineExceededError(
                "the request's deadline passed in the admission queue"
            ) from None
        if self.predicted_ttft_s is None:
            self.predicted_ttft_s = self.lease.prediction.ttft_s
        # After a move, the worker counts the streamed tokens at the prompt's end as output.
        request = wpb.DecodeRequest(
            request_id=ticket.request_id,
            prompt_token_ids=job.prompt_token_ids + self.output_token_ids,
            num_prior_output_tokens=len(self.output_token_ids),
            params=grpc_convert.sampling_proto(job.params),
            prefill_address=self.lease.prefill.address,
            router_queue_s=self.lease.queue_wait_s,
            prefill_here=self.lease.prefill is self.lease.decode,
        )
        timeout_s = job.remaining_s("before the decode worker was called")
        self.call = gateway.decode.generate(self.lease.decode.address, request, timeout_s)
        self._leg_has_token = False

    async def _next(self) -> pb.GenerateResponse:
        while True:
            try:
                message = await self._read()
            except WorkerLostError as lost:
                await self._move_on(lost, is_migration=True)
                continue
            except OverloadedError as busy:
                # A decode worker past its limits refuses before it has done anything: try
                # the others; only when every one refuses does the client get the 429.
                if busy.reason != "decode_kv" or self._leg_has_token:
                    raise
                await self._move_on(busy, is_migration=False)
                continue
            return self._forward(message)

    async def _read(self) -> pb.GenerateResponse:
        assert self.call is not None and self.lease is not None
        address = self.lease.decode.address
        try:
            message = await self.call.read()
        except grpc.aio.AioRpcError as e:
            raise error_of(e, address) from e
        if message is grpc.aio.EOF:
            raise WorkerLostError(f"decode worker {address} ended the stream before it finished")
        if message.finish_reason == "abort":
            raise WorkerLostError(f"decode worker {address} aborted the request")
        return message

    async def _move_on(self, error: RouterError, *, is_migration: bool) -> None:
        """Moves the request to another decode worker, or raises when it cannot: a migration
        (its worker was lost) at most max_migrations times, a refusal (the worker was full)
        once per decode worker."""
        assert self.lease is not None
        lost_id = self.lease.decode.worker_id
        self.close()  # cancels the lost call and hands its capacity back
        gateway = self.gateway
        if is_migration and self.num_migrations >= gateway.settings.max_migrations:
            raise error
        # Lost before its first token, a request starts over elsewhere as if new; after it,
        # a move resumes one token sequence, which two kinds of request cannot do:
        started = bool(self.output_token_ids)
        if is_migration and started and self.job.params.structured_output is not None:
            # The new worker's grammar would start over inside an output already half
            # written: the client gets the error instead of output that breaks its schema.
            raise error
        if is_migration and started and self.job.params.n > 1:
            # n samples are n sequences on one worker.
            raise error
        excluded = excluding(self.ticket, lost_id, gateway.pool)
        if excluded is None:
            if not is_migration:
                raise error
            raise UnavailableError(
                f"{error.message}; no other decode worker is left to continue it"
            )
        if not is_migration:
            metrics.DECODE_REFUSALS.labels(lost_id).inc()
            log.info("%s: %s; trying another decode worker", self.job.ticket.request_id,
                     error.message)  # fmt: skip
            self.ticket = replace(self.ticket, excluded_decode_ids=excluded)
            await self._dispatch()
            return
        self.num_migrations += 1
        metrics.MIGRATIONS.labels(lost_id).inc()
        num_streamed = len(self.output_token_ids)
        log.warning("%s: %s; moving it on after %d tokens", self.job.ticket.request_id,
                    error.message, num_streamed)  # fmt: skip
        if self._resumed is None and started:
            self._resumed = ResumedText.replay(
                gateway.tokenizer, self.job.params, self.output_token_ids, self.num_sent_chars
            )
        self.ticket = gateway.ticket(
            self.job.ticket.request_id, self.job.prompt_token_ids + self.output_token_ids,
            self.job.ticket.max_tokens - num_streamed, self.job.ticket.arrival_s, excluded,
            self.job.ticket.num_seqs,
        )  # fmt: skip
        await self._dispatch()

    def _forward(self, message: pb.GenerateResponse) -> pb.GenerateResponse:
        """The message as the client gets it: after a move, with the router's text and the
        usage of the whole request."""
        if self._resumed is not None:
            worker_usage = message.usage
            message = self._resumed.rewrite(message)
            if message.finish_reason:
                num_prompt = self.job.ticket.num_prompt_tokens
                message.usage.CopyFrom(pb.Usage(
                    prompt_tokens=num_prompt,
                    completion_tokens=len(self.output_token_ids) + len(message.token_ids),
                    cached_prompt_tokens=min(worker_usage.cached_prompt_tokens, num_prompt),
                ))  # fmt: skip
        self.output_token_ids.extend(message.token_ids)  # every sample's (moves have one)
        self.num_sent_chars += len(message.text)
        if message.token_ids:
            self._observe_token(message)
        if message.finish_reason:
            self._num_open -= 1
            if self._num_open == 0:
                self._observe_finish()
        return message

    def _observe_token(self, message: pb.GenerateResponse) -> None:
        now = time.monotonic()
        job, lease = self.job, self.lease
        assert lease is not None
        if not self._leg_has_token:
            self._leg_has_token = True
            lease.end_prefill()  # the prefill worker is done with it: free its budget
        if self._last_token_s is None:
            bucket = job.ticket.bucket
            metrics.child(metrics.TTFT, bucket, lease.prefill.worker_id).observe(
                now - job.received_s
            )
            t = message.ttft
            parts = {
                "tokenize": job.tokenize_s, "router_queue": lease.queue_wait_s,
                "prefill_queue": t.prefill_queue_s, "prefill_compute": t.prefill_compute_s,
                "kv_transfer": t.kv_transfer_s, "first_token_emit": t.first_token_emit_s,
            }  # fmt: skip
            for part, seconds in parts.items():
                metrics.child(metrics.TTFT_PART, part, bucket).observe(seconds)
        elif message.index > 0:
            return  # the gaps between one sequence's tokens: sample 0's
        else:
            gap_s = (now - self._last_token_s) / len(message.token_ids)
            metrics.child(metrics.INTER_TOKEN, lease.decode.worker_id).observe(gap_s)
        self._last_token_s = now

    def _observe_finish(self) -> None:
        elapsed_s = time.monotonic() - self.job.received_s
        metrics.child(metrics.E2E, self.job.ticket.bucket).observe(elapsed_s)
