"""The Prefill RPC: run chunked prefill and write each finished chunk's KV straight into the
decode worker's blocks, overlapping the transfer of chunk N with the compute of chunk N+1."""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field

import grpc

import kvtransfer
from engine.request import Request
from pdserve import wire
from pdserve.worker.v1 import worker_pb2 as wpb
from pdserve.worker.v1 import worker_pb2_grpc
from pdserve.worker_runtime import WorkerRuntime
from prefill_service import metrics

log = logging.getLogger(__name__)
TRANSFER_TIMEOUT_S = 60.0


@dataclass(slots=True)
class PrefillJob:
    """Transfer state of one request; touched only on the engine thread until it finishes."""

    request_id: str
    peer_metadata: bytes
    dst_block_ids: list[int]
    num_skipped_blocks: int  # the decode worker already holds these
    num_sent_blocks: int = 0
    held_block_ids: list[int] = field(default_factory=list)  # referenced until sent
    handles: list[kvtransfer.TransferHandle] = field(default_factory=list)
    sampler_state: bytes = b""
    error: Exception | None = None


class PrefillService(worker_pb2_grpc.PrefillServicer):
    def __init__(self, runtime: WorkerRuntime) -> None:
        self.runtime = runtime
        self.engine = runtime.engine
        self.block_size = runtime.settings.engine.block_size
        self.jobs: dict[str, PrefillJob] = {}
        self.engine.on_computed = self._ship_finished_blocks

    def Prefill(self, request: wpb.PrefillRequest, context: grpc.ServicerContext):
        with self.runtime.serving(context):
            return self._prefill(request, context)

    def _prefill(self, request: wpb.PrefillRequest, context: grpc.ServicerContext):
        rid, dest = request.request_id, request.kv_destination
        prompt = list(request.prompt_token_ids)
        self._check_destination(context, len(prompt), dest)
        # The prefill engine samples only the first token; stop rules are the decode's job.
        params = wire.call_or_abort(
            context, lambda: wire.sampling_params(request.params, max_tokens=1, ignore_eos=True)
        )
        job = PrefillJob(rid, dest.agent_metadata, list(dest.block_ids), dest.num_cached_blocks)
        loop = self.runtime.loop

        def admit():
            engine_request = self.engine.add_request(rid, prompt, params)
            self.jobs[rid] = job
            return engine_request, loop.open_stream(rid)

        engine_request, stream = wire.call_or_abort(context, lambda: loop.call(admit))
        context.add_callback(lambda: loop.abort(rid))  # the decode worker gave up on us
        bucket = self.runtime.settings.length_buckets.of(len(prompt))
        try:
            final = None
            for output in stream:
                final = output
            first_token_done = time.monotonic()
            for handle in job.handles:
                handle.wait(TRANSFER_TIMEOUT_S)
            if job.error is not None:
                raise job.error
        except kvtransfer.KVHeaderMismatchError as e:
            metrics.REQUESTS.labels("kv_mismatch").inc()
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
        except kvtransfer.KVTransferError as e:
            metrics.REQUESTS.labels("kv_failed").inc()
            context.abort(grpc.StatusCode.UNAVAILABLE, f"KV transfer failed: {e}")
        finally:
            loop.post(lambda: self._release(job))
        if final is None or final.finish_reason == "abort":
            metrics.REQUESTS.labels("aborted").inc()
            context.abort(grpc.StatusCode.CANCELLED, "prefill was cancelled")
        r = engine_request
        queue_wait = (r.first_scheduled_time_s or r.arrival_time_s) - r.arrival_time_s
        compute = (r.first_token_time_s or first_token_done) - (r.first_scheduled_time_s or 0)
        transfer = time.monotonic() - first_token_done
        metrics.QUEUE_WAIT.labels(bucket).observe(queue_wait)
        metrics.COMPUTE.labels(bucket).observe(compute)
        metrics.TRANSFER_WAIT.labels(bucket).observe(transfer)
        metrics.REQUESTS.labels("ok").inc()
        return wpb.PrefillResponse(
            first_token_id=final.new_token_ids[0],
            num_prompt_tokens=len(prompt),
            num_prefix_hit_tokens=r.num_cached_tokens,
            kv_bytes_sent=sum(h.num_bytes for h in job.handles),
            num_blocks_sent=job.num_sent_blocks - job.num_skipped_blocks,
            queue_wait_s=queue_wait,
            compute_s=compute,
            transfer_s=transfer,
            sampler_state=job.sampler_state,
        )

    def _check_destination(self, context, num_prompt_tokens: int, dest) -> None:
        if num_prompt_tokens == 0:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "prompt_token_ids is empty")
        num_blocks = -(-num_prompt_tokens // self.block_size)
        if len(dest.block_ids) != num_blocks:
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"kv_destination has {len(dest.block_ids)} block ids; a {num_prompt_tokens}-token "
                f"prompt needs {num_blocks} blocks of {self.block_size}",
            )
        if dest.num_cached_blocks >= num_blocks:
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"num_cached_blocks {dest.num_cached_blocks} leaves nothing to send of "
                f"{num_blocks} blocks (the last block is always sent)",
            )

    def _ship_finished_blocks(self, request: Request) -> None:
        """Engine thread, after each step: send every block that is now final. A block is final
        when full, and the last partial block once the whole prompt is computed."""
        job = self.jobs.get(request.request_id)
        if job is None or job.error is not None:
            return
        computed = min(request.num_computed_tokens, request.num_prompt_tokens)
        if computed == request.num_prompt_tokens:
            num_final = -(-computed // self.block_size)
            job.sampler_state = request.sampler_state()  # the first token was just sampled
        else:
            num_final = computed // self.block_size
        start = max(job.num_sent_blocks, job.num_skipped_blocks)
        if num_final <= start:
            return
        src = request.block_ids[start:num_final]
        # Hold a reference so the blocks outlive the request until the bytes have left.
        self.engine.pool.touch(src)
        job.held_block_ids.extend(src)
        job.num_sent_blocks = num_final
        try:
            handle = self.runtime.kv_agent.send(
                job.peer_metadata, job.request_id, src, job.dst_block_ids[start:num_final]
            )
            job.handles.append(handle)
        except (kvtransfer.KVTransferError, ValueError) as e:
            job.error = e
            self.runtime.loop.abort(job.request_id)

    def _release(self, job: PrefillJob) -> None:
        """Engine thread: drop the send references, once every handle has resolved."""
        self.jobs.pop(job.request_id, None)
        if all(h.is_done() for h in job.handles):
            self.engine.pool.free(job.held_block_ids)
            return
        # A send still running (its peer is slow): check again shortly, without blocking.
        timer = threading.Timer(0.05, self.runtime.loop.post, args=(lambda: self._release(job),))
        timer.daemon = True
        timer.start()
