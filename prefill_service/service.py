"""The Prefill RPC: run chunked prefill and write each finished chunk's KV straight into the
decode worker's blocks, overlapping the transfer of chunk N with the compute of chunk N+1.
A prefix the decode worker already holds and we lack is read from it first (peer_fetch.py)."""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass, field

import grpc

import kvtransfer
from engine import InvalidRequestError
from engine.errors import EngineStoppedError
from engine.request import Request
from pdserve import grpc_convert
from pdserve.grpc_convert import CallerGoneError
from pdserve.worker.v1 import worker_pb2 as wpb
from pdserve.worker.v1 import worker_pb2_grpc
from pdserve.worker_runtime import WorkerRuntime
from prefill_service import metrics
from prefill_service.peer_fetch import Fetched, PrefixFetcher
from prefill_service.request_path import Shipment, first_token_params

log = logging.getLogger(__name__)
DEFAULT_TIMEOUT_S = 600.0  # for a caller that sets no deadline


@dataclass(slots=True)
class PrefillJob:
    """Transfer state of one request; touched only on the engine thread until it finishes."""

    request_id: str
    peer_metadata: bytes
    dst_block_ids: list[int]
    shipment: Shipment
    held_block_ids: list[int] = field(default_factory=list)  # referenced until sent
    handles: list[kvtransfer.TransferHandle] = field(default_factory=list)
    fetched: Fetched = field(default_factory=Fetched)  # the prefix read from the decode worker
    sampler_state: bytes = b""
    error: Exception | None = None


class PrefillService(worker_pb2_grpc.PrefillServicer):
    def __init__(self, runtime: WorkerRuntime) -> None:
        self.runtime = runtime
        self.engine = runtime.engine
        self.block_size = runtime.settings.engine.block_size
        self.jobs: dict[str, PrefillJob] = {}
        self.fetcher = PrefixFetcher(runtime)
        self.engine.on_computed = self._ship_finished_blocks

    def Prefill(self, request: wpb.PrefillRequest, context: grpc.ServicerContext):
        with self.runtime.serving(context), grpc_convert.statuses(context):
            return self._prefill(request, context)

    def _prefill(self, request: wpb.PrefillRequest, context: grpc.ServicerContext):
        rid, dest = request.request_id, request.kv_destination
        prompt = list(request.prompt_token_ids)
        self._check_destination(len(prompt), dest)
        remaining_s = context.time_remaining()
        deadline_s = time.monotonic() + (DEFAULT_TIMEOUT_S if remaining_s is None else remaining_s)
        num_prior = request.num_prior_output_tokens
        params = first_token_params(grpc_convert.sampling_params(request.params), num_prior)
        job = PrefillJob(rid, dest.agent_metadata, list(dest.block_ids),
                         Shipment(dest.num_cached_blocks))  # fmt: skip
        loop = self.runtime.loop

        def admit():
            engine_request = self.engine.add_request(rid, prompt, params, num_prior)
            engine_request.prefix_looked_up = job.fetched.looked_up
            self.jobs[rid] = job
            return engine_request, loop.open_stream(rid)

        bucket = self.runtime.settings.length_buckets.of(len(prompt))
        final = None
        try:
            job.fetched = self.fetcher.fetch(rid, prompt, dest, deadline_s)
            if not context.is_active():  # cancelled during the fetch, before the abort below
                raise CallerGoneError("prefill was cancelled")
            engine_request, stream = loop.call(admit)
            # The decode worker gave up on us, or the deadline passed: the stream ends "abort".
            context.add_callback(lambda: loop.abort(rid))
            for output in stream:
                final = output
            first_token_done = time.monotonic()
            for handle in list(job.handles):
                handle.wait(max(0.0, deadline_s - time.monotonic()))
            if job.error is not None:
                raise job.error
        except kvtransfer.KVHeaderMismatchError as e:
            metrics.REQUESTS.labels("kv_mismatch").inc()
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
        except kvtransfer.KVTransferError as e:
            metrics.REQUESTS.labels("kv_failed").inc()
            context.abort(grpc.StatusCode.UNAVAILABLE, f"KV transfer failed: {e}")
        finally:
            finished = final is not None and final.finished and final.finish_reason != "abort"
            self._settle(job, deadline_s, finished)
        if final is None or final.finish_reason == "abort":
            metrics.REQUESTS.labels("aborted").inc()
            raise CallerGoneError("prefill was cancelled")
        r = engine_request
        queue_wait = (r.first_scheduled_time_s or r.arrival_time_s) - r.arrival_time_s
        compute = (r.first_token_time_s or first_token_done) - (r.first_scheduled_time_s or 0)
        transfer = time.monotonic() - first_token_done
        metrics.QUEUE_WAIT.labels(bucket).observe(queue_wait)
        metrics.COMPUTE.labels(bucket).observe(compute)
        metrics.TRANSFER_WAIT.labels(bucket).observe(transfer)
        metrics.REQUESTS.labels("ok").inc()
        # Held since the fetch, the fetched blocks are hits of the request's prefix match.
        num_fetched = min(job.fetched.num_tokens, r.num_cached_tokens)
        metrics.PROMPT_TOKENS.labels("computed").inc(len(prompt) - r.num_cached_tokens)
        metrics.PROMPT_TOKENS.labels("prefix_cache").inc(r.num_cached_tokens - num_fetched)
        metrics.PROMPT_TOKENS.labels("peer_fetch").inc(num_fetched)
        return wpb.PrefillResponse(
            first_token_id=final.new_token_ids[0],
            num_prompt_tokens=len(prompt),
            num_prefix_hit_tokens=r.num_cached_tokens - num_fetched,
            num_peer_fetched_tokens=num_fetched,
            kv_bytes_sent=sum(h.num_bytes for h in job.handles),
            num_blocks_sent=job.shipment.num_sent_blocks - job.shipment.num_skipped_blocks,
            queue_wait_s=queue_wait,
            compute_s=compute,
            transfer_s=job.fetched.seconds + transfer,
            sampler_state=job.sampler_state,
            first_token_logprobs=(
                grpc_convert.logprobs_proto(final.logprobs[0]) if final.logprobs else None
            ),
        )

    def _check_destination(self, num_prompt_tokens: int, dest) -> None:
        if num_prompt_tokens == 0:
            raise InvalidRequestError("prompt_token_ids is empty")
        num_blocks = -(-num_prompt_tokens // self.block_size)
        if len(dest.block_ids) != num_blocks:
            raise InvalidRequestError(
                f"kv_destination has {len(dest.block_ids)} block ids; a {num_prompt_tokens}-token "
                f"prompt needs {num_blocks} blocks of {self.block_size}",
            )
        if dest.num_cached_blocks >= num_blocks:
            raise InvalidRequestError(
                f"num_cached_blocks {dest.num_cached_blocks} leaves nothing to send of "
                f"{num_blocks} blocks (the last block is always sent)",
            )

    def _ship_finished_blocks(self, request: Request) -> None:
        """Engine thread, after each step: send every block that is now final."""
        job = self.jobs.get(request.request_id)
        if job is None or job.error is not None:
            return
        if request.num_computed_tokens >= request.num_prompt_tokens:
            job.sampler_state = request.sampler_state()  # the first token was just sampled
        final = job.shipment.take_final_blocks(request, self.engine.kv)
        if final is None:
            return
        src = request.block_ids[final]
        job.held_block_ids.extend(src)  # released by _settle, once the bytes have left
        try:
            handle = self.runtime.kv_agent.send(
                job.peer_metadata, job.request_id, src, job.dst_block_ids[final]
            )
            job.handles.append(handle)
        except (kvtransfer.KVTransferError, ValueError) as e:
            job.error = e
            self.runtime.loop.abort(job.request_id)

    def _settle(self, job: PrefillJob, deadline_s: float, finished: bool) -> None:
        """Stops the job's shipping, then drops its send references once every send has
        resolved, or at the deadline: by then the receiver has given up on these bytes and
        fenced its blocks, so our source blocks may be reused. Then the blocks a fetch held.

        A request that finished had its last blocks shipped on the engine thread before its
        final output came out, and no later step ships for it: its job is dropped without
        waiting. Otherwise (aborted, failed) the engine may still be stepping it, so this waits
        for the step in progress to end; a finished request waiting there would hold its
        first token back from the decode worker for a whole step of other requests' work."""
        loop = self.runtime.loop

        def forget() -> None:
            self.jobs.pop(job.request_id, None)

        with contextlib.suppress(EngineStoppedError):  # the process is going away
            if finished:
                loop.post(forget)
            else:
                loop.call(forget)
        for handle in job.handles:
            with contextlib.suppress(kvtransfer.KVTransferError):  # its outcome is reported
                handle.wait(max(0.0, deadline_s - time.monotonic()))
        held = job.held_block_ids + job.fetched.held_block_ids
        with contextlib.suppress(EngineStoppedError):
            loop.post(lambda: self.engine.kv.release(held))
