"""The request path both APIs share: tokenize once, check the limits, admit, call the chosen
decode worker (naming the chosen prefill worker), and stream its messages back."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import grpc

from engine import InvalidRequestError, SamplingParams
from engine.tokenizer import ChatTemplateError, TextTokenizer
from pdserve import wire
from pdserve.v1 import generation_pb2 as pb
from pdserve.worker.v1 import worker_pb2 as wpb
from router import metrics
from router.admission import Admission, Lease
from router.errors import InvalidRequest, PromptTooLong, Unavailable
from router.settings import RouterSettings
from router.ticket import Ticket, affinity_key
from router.upstream import DecodeClient, error_of
from router.workers import WorkerPool


@dataclass(frozen=True, slots=True)
class Job:
    ticket: Ticket
    prompt_token_ids: list[int]
    params: SamplingParams
    received_s: float  # monotonic: the request reached the router
    tokenize_s: float


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
        lengths = [w.max_model_len for role in ("prefill", "decode") for w in self.pool.infos(role)]
        if not lengths:
            raise Unavailable("no worker is registered; retry when one is up")
        return min(lengths)

    async def render_chat(self, messages: list[dict[str, str]]) -> str:
        try:
            return await asyncio.to_thread(self.tokenizer.apply_chat_template, messages)
        except ChatTemplateError as e:
            raise InvalidRequest(str(e), param="messages") from e

    async def tokenize(self, text: str, param: str = "prompt") -> list[int]:
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:  # lone surrogates from JSON escapes
            raise InvalidRequest(f"{param} is not valid Unicode: {e.reason}", param=param) from e
        return await asyncio.to_thread(self.tokenizer.encode, text)

    def job(
        self, prompt_token_ids: list[int], make_params: Callable[[int], SamplingParams],
        received_s: float, param: str = "prompt",
    ) -> Job:  # fmt: skip
        """Checks the limits. make_params gets the context room left after the prompt (the
        chat API's default max_tokens)."""
        num_prompt = len(prompt_token_ids)
        if num_prompt == 0:
            raise InvalidRequest(f"{param} is empty", param=param)
        context = self.max_model_len()
        max_prompt = min(self.settings.max_prompt_tokens or context - 1, context - 1)
        if num_prompt > max_prompt:
            raise PromptTooLong(
                f"{param} has {num_prompt} tokens; this server takes at most {max_prompt}", param
            )
        try:
            params = make_params(context - num_prompt)
        except InvalidRequestError as e:
            raise InvalidRequest(str(e)) from e
        if num_prompt + params.max_tokens > context:
            raise PromptTooLong(
                f"this model's maximum context length is {context} tokens, but {num_prompt} "
                f"prompt tokens + max_tokens {params.max_tokens} would need "
                f"{num_prompt + params.max_tokens}", "max_tokens",
            )  # fmt: skip
        admission = self.settings.admission
        num_reserved = num_prompt + min(params.max_tokens, admission.kv_output_reserve_tokens)
        ticket = Ticket(
            request_id=uuid.uuid4().hex,
            num_prompt_tokens=num_prompt,
            max_tokens=params.max_tokens,
            num_kv_blocks=-(-num_reserved // admission.kv_block_size),
            bucket=admission.buckets.of(num_prompt),
            arrival_s=time.monotonic(),
            affinity_key=affinity_key(prompt_token_ids),
        )
        return Job(ticket, prompt_token_ids, params, received_s, ticket.arrival_s - received_s)

    async def open(self, job: Job) -> Run:
        """Admits the job and starts it; returns once the first message is in (so an early
        error can still become a proper status), or raises a RouterError."""
        lease = await self.admission.admit(job.ticket)
        request = wpb.DecodeRequest(
            request_id=job.ticket.request_id,
            prompt_token_ids=job.prompt_token_ids,
            params=wire.sampling_proto(job.params),
            prefill_address=lease.prefill.address,
            router_queue_s=lease.queue_wait_s,
        )
        run = Run(job, lease, self.decode.generate(lease.decode.address, request))
        try:
            await run.start()
        except BaseException:
            run.close()
            raise
        return run


class Run:
    """One admitted request in flight: the decode worker's messages, observed on the way."""

    def __init__(self, job: Job, lease: Lease, call: grpc.aio.UnaryStreamCall) -> None:
        self.job = job
        self.lease = lease
        self.call = call
        self.first: pb.GenerateResponse | None = None
        self._last_token_s: float | None = None
        self._finished = False

    async def start(self) -> None:
        self.first = await self._next()

    async def messages(self) -> AsyncIterator[pb.GenerateResponse]:
        """Every message, the first included, up to the one with a finish reason."""
        assert self.first is not None, "start() first"
        message = self.first
        while True:
            yield message
            if message.finish_reason:
                return
            message = await self._next()

    def close(self) -> None:
        """Synchronous on purpose: it runs in `finally` blocks of cancelled tasks."""
        self.call.cancel()  # no-op once the call has ended; aborts the request otherwise
        self.lease.end()

    async def _next(self) -> pb.GenerateResponse:
        address = self.lease.decode.address
        try:
            message = await self.call.read()
        except grpc.aio.AioRpcError as e:
            raise error_of(e, address) from e
        if message is grpc.aio.EOF:
            raise Unavailable(f"decode worker {address} ended the stream before it finished")
        if message.finish_reason == "abort":
            raise Unavailable(f"decode worker {address} aborted the request")
        if message.token_ids:
            self._observe_token(message)
        if message.finish_reason:
            self._observe_finish()
        return message

    def _observe_token(self, message: pb.GenerateResponse) -> None:
        now = time.monotonic()
        job, lease = self.job, self.lease
        if self._last_token_s is None:
            lease.end_prefill()  # the prefill worker is done with it: free its budget
            bucket = job.ticket.bucket
            metrics.TTFT.labels(bucket, lease.prefill.worker_id).observe(now - job.received_s)
            t = message.ttft
            parts = {
                "tokenize": job.tokenize_s, "router_queue": lease.queue_wait_s,
                "prefill_queue": t.prefill_queue_s, "prefill_compute": t.prefill_compute_s,
                "kv_transfer": t.kv_transfer_s, "first_token_emit": t.first_token_emit_s,
            }  # fmt: skip
            for part, seconds in parts.items():
                metrics.TTFT_PART.labels(part, bucket).observe(seconds)
        else:
            gap_s = (now - self._last_token_s) / len(message.token_ids)
            metrics.INTER_TOKEN.labels(lease.decode.worker_id).observe(gap_s)
        self._last_token_s = now

    def _observe_finish(self) -> None:
        if not self._finished:
            self._finished = True
            elapsed_s = time.monotonic() - self.job.received_s
            metrics.E2E.labels(self.job.ticket.bucket).observe(elapsed_s)
