"""The decode worker's Generate RPC: reserve KV blocks, have a prefill worker fill them (retrying
once elsewhere), then stream tokens from the continuous batch."""

from __future__ import annotations

import logging
import threading
import time
import uuid
from dataclasses import dataclass

import grpc

import kvtransfer
from decode_service import metrics
from engine import InvalidRequestError, SamplingParams
from engine.request import Request, StepOutput
from pdserve import wire
from pdserve.tls import open_channel
from pdserve.v1 import generation_pb2 as pb
from pdserve.worker.v1 import worker_pb2 as wpb
from pdserve.worker.v1 import worker_pb2_grpc
from pdserve.worker_runtime import WorkerRuntime

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class DecodeSettings:
    prefill_timeout_s: float = 60.0  # one Prefill RPC, KV landing included
    max_prefill_attempts: int = 2  # the router's pick, then one other prefill worker
    local_prefill_fallback: bool = False  # prefill here when no prefill worker succeeds


class PrefillFailedError(RuntimeError):
    pass


class DecodeService(worker_pb2_grpc.DecodeServicer):
    def __init__(self, runtime: WorkerRuntime, settings: DecodeSettings | None = None) -> None:
        self.runtime = runtime
        self.engine = runtime.engine
        self.settings = settings or DecodeSettings()
        self.block_size = runtime.settings.engine.block_size
        self._channels: dict[str, worker_pb2_grpc.PrefillStub] = {}
        self._channels_lock = threading.Lock()

    def Generate(self, request: wpb.DecodeRequest, context: grpc.ServicerContext):
        with self.runtime.serving(context):
            yield from self._generate(request, context)

    def _generate(self, request: wpb.DecodeRequest, context: grpc.ServicerContext):
        rid = request.request_id or uuid.uuid4().hex
        prompt = list(request.prompt_token_ids)
        params = wire.call_or_abort(context, lambda: wire.sampling_params(request.params))
        loop = self.runtime.loop
        reserved: Request = wire.call_or_abort(
            context,
            lambda: loop.call(lambda: self.engine.reserve_for_remote_prefill(rid, prompt, params)),
        )
        finished = False
        context.add_callback(lambda: finished or loop.abort(rid))  # client went away
        bucket = self.runtime.settings.length_buckets.of(len(prompt))
        started = time.monotonic()
        try:
            prefill: wpb.PrefillResponse | None = None
            try:
                prefill = self._remote_prefill(rid, prompt, params, reserved, request)
            except InvalidRequestError as e:
                metrics.REQUESTS.labels("invalid").inc()
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
            except PrefillFailedError as e:
                if not self.settings.local_prefill_fallback:
                    metrics.REQUESTS.labels("prefill_failed").inc()
                    context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
                log.warning("%s: %s; prefilling locally", rid, e)
                first, stream = None, loop.call(lambda: self._restart_locally(rid, prompt, params))
            else:
                metrics.PREFILL_SECONDS.labels(bucket).observe(time.monotonic() - started)
                first, stream = loop.call(lambda: self._commit(rid, prefill))
            ttft_sent = False
            for output in _chain(first, stream):
                message = wire.response(output)
                if output.new_token_ids and not ttft_sent:
                    ttft_sent = True
                    message.ttft.CopyFrom(_ttft(request, prefill, started))
                if output.finished:
                    finished = True
                    message.usage.CopyFrom(self._usage(reserved, prefill))
                yield message
            metrics.REQUESTS.labels("ok").inc()
        finally:
            if not finished:
                loop.abort(rid)

    def _commit(self, rid: str, prefill: wpb.PrefillResponse):
        """Engine thread: the first token joins, and later tokens flow into a new stream (no
        step can run in between, so none is missed)."""
        first = self.engine.commit_remote_prefill(
            rid, prefill.first_token_id, prefill.sampler_state
        )
        return first, None if first.finished else self.runtime.loop.open_stream(rid)

    def _restart_locally(self, rid: str, prompt: list[int], params: SamplingParams):
        self.engine.abort_request(rid)
        self.engine.add_request(rid, prompt, params)
        return self.runtime.loop.open_stream(rid)

    def _remote_prefill(
        self, rid: str, prompt: list[int], params: SamplingParams, reserved: Request,
        request: wpb.DecodeRequest,
    ) -> wpb.PrefillResponse:  # fmt: skip
        num_cached_blocks = reserved.num_cached_tokens // self.block_size
        dst = list(reserved.block_ids)
        message = wpb.PrefillRequest(
            prompt_token_ids=prompt,
            params=wire.sampling_proto(params),
            kv_destination=wpb.KVDestination(
                agent_metadata=self.runtime.kv_agent.metadata(),
                block_ids=dst,
                num_cached_blocks=num_cached_blocks,
            ),
        )
        agent = self.runtime.kv_agent
        errors = []
        for attempt, address in enumerate(self._prefill_targets(request.prefill_address)):
            # A fresh transfer id per attempt: bytes still in flight from a failed attempt can
            # never be mistaken for the retry's.
            transfer_id = f"{rid}/{attempt}"
            message.request_id = transfer_id
            agent.expect(transfer_id, dst[num_cached_blocks:])
            try:
                response = self._stub(address).Prefill(
                    message, timeout=self.settings.prefill_timeout_s
                )
                agent.wait(transfer_id, self.settings.prefill_timeout_s)
                metrics.PREFILL_ATTEMPTS.labels("ok").inc()
                return response
            except grpc.RpcError as e:
                agent.cancel(transfer_id)
                if e.code() == grpc.StatusCode.INVALID_ARGUMENT:
                    # The request itself is bad: another worker would say the same.
                    raise InvalidRequestError(f"prefill rejected the request: {e.details()}") from e
                errors.append(f"{address}: {e.code().name} {e.details()}")
            except kvtransfer.KVTransferError as e:
                agent.cancel(transfer_id)
                errors.append(f"{address}: {e}")
            metrics.PREFILL_ATTEMPTS.labels("failed").inc()
            log.warning("%s: prefill on %s failed: %s", rid, address, errors[-1])
        raise PrefillFailedError(
            "prefill failed on every worker tried: " + "; ".join(errors or ["no prefill worker"])
        )

    def _prefill_targets(self, preferred: str) -> list[str]:
        """The router's pick first, then the least-loaded others from the registry."""
        try:
            workers = self.runtime.registry.workers("prefill")
        except Exception as e:  # the registry is advisory here: keep the router's pick
            log.warning("registry unavailable: %s", e)
            workers = []
        others = sorted(
            (w for w in workers if w.address != preferred), key=lambda w: w.load.queued_tokens
        )
        targets = ([preferred] if preferred else []) + [w.address for w in others]
        return targets[: self.settings.max_prefill_attempts]

    def _stub(self, address: str) -> worker_pb2_grpc.PrefillStub:
        with self._channels_lock:
            if address not in self._channels:
                channel = open_channel(address, self.runtime.settings.tls)
                self._channels[address] = worker_pb2_grpc.PrefillStub(channel)
            return self._channels[address]

    def _usage(self, reserved: Request, prefill: wpb.PrefillResponse | None) -> pb.Usage:
        return pb.Usage(
            prompt_tokens=reserved.num_prompt_tokens,
            completion_tokens=reserved.num_output_tokens,
            cached_prompt_tokens=prefill.num_prefix_hit_tokens if prefill else 0,
        )


def _chain(first: StepOutput | None, stream):
    if first is not None:
        yield first
    if stream is not None:
        yield from stream


def _ttft(request: wpb.DecodeRequest, prefill, started: float) -> pb.TtftBreakdown:
    if prefill is None:
        return pb.TtftBreakdown(router_queue_s=request.router_queue_s)
    return pb.TtftBreakdown(
        router_queue_s=request.router_queue_s,
        prefill_queue_s=prefill.queue_wait_s,
        prefill_compute_s=prefill.compute_s,
        kv_transfer_s=prefill.transfer_s,
        first_token_emit_s=max(0.0, time.monotonic() - started - prefill.queue_wait_s
                               - prefill.compute_s - prefill.transfer_s),
    )  # fmt: skip
