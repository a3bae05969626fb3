"""The decode worker's Generate RPC: reserve KV blocks, have a prefill worker fill them (retrying
once elsewhere), then stream tokens from the continuous batch. An aggregated worker skips the
remote part: the request joins its batch whole, its prompt prefilled in chunks between decode
steps (the same path the local-prefill fallback takes).

Blocks reserved for a remote prefill are freed only once their writer is fenced: a request
that ends during its prefill (the client went away, a deadline, a failed attempt) first cancels
the Prefill call and stops the KV transfer; blocks whose writer did not confirm are not freed
but quarantined in the engine until that writer is known done or dead (unfenced_writers.py).
"""

from __future__ import annotations

import logging
import math
import threading
import time
import uuid

import grpc

import kvtransfer
from decode_service import metrics
from decode_service.settings import DecodeSettings
from decode_service.unfenced_writers import UnfencedWriters
from engine import InvalidRequestError, SamplingParams
from engine.engine_loop import RequestStream
from engine.errors import EngineDiedError
from engine.request import Request
from pdserve import grpc_convert, keepalive
from pdserve.grpc_convert import CallerGoneError, DeadlineExceededError, PrefillFailedError
from pdserve.tls import open_channel
from pdserve.v1 import generation_pb2 as pb
from pdserve.worker.v1 import worker_pb2 as wpb
from pdserve.worker.v1 import worker_pb2_grpc
from pdserve.worker_runtime import WorkerRuntime

log = logging.getLogger(__name__)


class AttemptFailedError(RuntimeError):
    """One prefill attempt failed in a way another prefill worker may not."""


class PrefillWatch:
    """The prefill phase of one request, which other threads may end early: the client went
    away (CallerGoneError) or the engine died (EngineDiedError). Once decoding has begun,
    the engine owns the request and ends it itself."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._call: grpc.Future | None = None
        self._decoding = False
        self.interruption: Exception | None = None

    def interrupt(self, reason: Exception) -> bool:
        """Ends the prefill phase; False when decoding has already begun."""
        with self._lock:
            if self._decoding:
                return False
            self.interruption = self.interruption or reason
            call = self._call
        if call is not None:
            call.cancel()
        return True

    def call(self, future: grpc.Future, timeout_s: float) -> wpb.PrefillResponse:
        with self._lock:
            self._call = future
            interrupted = self.interruption is not None
        if interrupted:
            future.cancel()
        try:
            return future.result(timeout=timeout_s)
        except grpc.FutureCancelledError:
            raise self.interruption or CallerGoneError("the prefill call was cancelled") from None
        except grpc.FutureTimeoutError:
            future.cancel()
            message = f"prefill did not finish within {timeout_s:.1f} s"
            raise DeadlineExceededError(message) from None
        finally:
            with self._lock:
                self._call = None

    def begin_decoding(self) -> None:
        with self._lock:
            if self.interruption is not None:
                raise self.interruption
            self._decoding = True


class DecodeService(worker_pb2_grpc.DecodeServicer):
    def __init__(self, runtime: WorkerRuntime, settings: DecodeSettings | None = None) -> None:
        self.runtime = runtime
        self.engine = runtime.engine
        self.loop = runtime.loop
        self.settings = settings or DecodeSettings()
        self.unfenced_writers = UnfencedWriters(
            lambda ids: self.loop.post(lambda: self.engine.kv.release_quarantined(ids))
        )
        self._channels: dict[str, worker_pb2_grpc.PrefillStub] = {}
        self._watches: dict[str, PrefillWatch] = {}
        self._lock = threading.Lock()
        runtime.death_hooks.append(self._on_engine_death)

    def Generate(self, request: wpb.DecodeRequest, context: grpc.ServicerContext):
        with self.runtime.serving(context), grpc_convert.statuses(context):
            rid = request.request_id or uuid.uuid4().hex
            watch = PrefillWatch()
            with self._lock:
                self._watches[rid] = watch
            try:
                yield from self._generate(rid, request, context, watch)
            finally:
                with self._lock:
                    self._watches.pop(rid, None)

    def _generate(
        self, rid: str, request: wpb.DecodeRequest, context: grpc.ServicerContext,
        watch: PrefillWatch,
    ):  # fmt: skip
        received_s = time.monotonic()
        prompt = list(request.prompt_token_ids)
        params = grpc_convert.sampling_params(request.params)
        num_prior = request.num_prior_output_tokens
        n = params.n
        remaining_s = context.time_remaining()
        deadline_s = time.monotonic() + min(
            math.inf if remaining_s is None else remaining_s, self.settings.prefill_timeout_s
        )
        loop = self.loop
        # Prefilled here: an aggregated worker always, a decode worker when the router asks.
        prefill_here = self.settings.aggregated or request.prefill_here
        if prefill_here:  # decoding from the start: the engine owns the request (and aborts it)
            watch.begin_decoding()
            reserved, stream = loop.call(
                lambda: self._start_locally(rid, prompt, params, num_prior)
            )
        else:
            reserved = loop.call(
                lambda: self.engine.reserve_for_remote_prefill(rid, prompt, params, num_prior)
            )
        # Runs when the call ends for any reason: in the prefill phase it only interrupts (the
        # handler fences, then frees); once decoding, the engine aborts (a no-op if finished).
        context.add_callback(
            lambda: watch.interrupt(CallerGoneError("the caller went away")) or loop.abort(rid, n)
        )
        bucket = self.runtime.settings.length_buckets.of(len(prompt))
        started = time.monotonic()
        finished = False
        try:
            prefill: wpb.PrefillResponse | None = None
            try:
                if not prefill_here:
                    prefill = self._remote_prefill(
                        rid, reserved, request, params, watch, deadline_s
                    )
            except PrefillFailedError as e:
                if not self.settings.local_prefill_fallback:
                    metrics.REQUESTS.labels("prefill_failed").inc()
                    raise
                log.warning("%s: %s; prefilling locally", rid, e)
                watch.begin_decoding()
                stream = loop.call(lambda: self._restart_locally(rid, prompt, params, num_prior))
            else:
                if prefill is not None:
                    metrics.PREFILL_SECONDS.labels(bucket).observe(time.monotonic() - started)
                    watch.begin_decoding()
                    stream = loop.call(lambda: self._commit(rid, prefill, n))
            ttft_sent = False
            num_output_tokens = 0  # every sample's
            for output in stream:
                message = grpc_convert.response(output)
                num_output_tokens += len(output.new_token_ids)
                metrics.OUTPUT_TOKENS.inc(len(output.new_token_ids))
                if output.new_token_ids and not ttft_sent:
                    ttft_sent = True
                    message.ttft.CopyFrom(
                        _local_ttft(request, reserved, received_s)
                        if prefill_here
                        else _ttft(request, prefill, started)
                    )
                if stream.is_done:  # the last sample's last message
                    finished = True
                    message.usage.CopyFrom(
                        self._usage(reserved, prefill, num_output_tokens, prefill_here)
                    )
                yield message
            metrics.REQUESTS.labels("ok").inc()
        except InvalidRequestError:
            metrics.REQUESTS.labels("invalid").inc()
            raise
        finally:
            if not finished:
                loop.abort(rid, n)

    def _commit(self, rid: str, prefill: wpb.PrefillResponse, n: int) -> RequestStream:
        """Engine thread: the first token joins, then the samples' later tokens (no step can
        run in between, so none is missed), in one stream; the first token forks samples
        1..n-1 (LLMEngine._fork)."""
        if rid not in self.engine.requests:  # aborted after its KV landed
            raise CallerGoneError("the caller went away")
        first_logprobs = None
        if prefill.HasField("first_token_logprobs"):
            first_logprobs = grpc_convert.token_logprobs(prefill.first_token_logprobs)
        stream = self.loop.open_stream(rid, n)
        self.loop.route(self.engine.commit_remote_prefill(
            rid, prefill.first_token_id, prefill.sampler_state, first_logprobs
        ))  # fmt: skip
        return stream

    def _restart_locally(
        self, rid: str, prompt: list[int], params: SamplingParams, num_prior: int
    ) -> RequestStream:
        self.engine.abort_request(rid)
        self.engine.add_request(rid, prompt, params, num_prior)
        return self.loop.open_stream(rid, params.n)

    def _start_locally(
        self, rid: str, prompt: list[int], params: SamplingParams, num_prior: int
    ) -> tuple[Request, RequestStream]:
        """Engine thread, aggregated: the request and its token stream (usage reads it)."""
        stream = self._restart_locally(rid, prompt, params, num_prior)
        return self.engine.requests[rid], stream

    def _remote_prefill(
        self, rid: str, reserved: Request, request: wpb.DecodeRequest, params: SamplingParams,
        watch: PrefillWatch, deadline_s: float,
    ) -> wpb.PrefillResponse:  # fmt: skip
        """Asks prefill workers in turn to fill the reserved blocks, each attempt under a fresh
        transfer id (bytes still in flight from a failed attempt can never count for the
        next); every failed attempt is fenced before the next starts or the request ends."""
        num_cached_blocks = self.engine.kv.first_remote_block(reserved)
        # Our prefix hits stay held, full and unchanged, until the request ends, and we free
        # them only after forgetting its transfer id: the prefill worker may read them meanwhile.
        readable = self.runtime.settings.peer_fetch and num_cached_blocks > 0
        message = wpb.PrefillRequest(
            prompt_token_ids=reserved.prompt_token_ids,
            params=grpc_convert.sampling_proto(params),
            num_prior_output_tokens=request.num_prior_output_tokens,
            kv_destination=wpb.KVDestination(
                agent_metadata=self.runtime.kv_agent.metadata(),
                num_cached_blocks=num_cached_blocks,
                cached_blocks_readable=readable,
            ),
        )
        targets = self._prefill_targets(request.prefill_address)
        errors = []
        for attempt, address in enumerate(targets):
            transfer_id = f"{rid}/{attempt}"
            dst = list(reserved.block_ids)  # fresh blocks after an unfenced attempt
            message.request_id = transfer_id
            message.kv_destination.ClearField("block_ids")
            message.kv_destination.block_ids.extend(dst)
            held = dst[:num_cached_blocks] if readable else []
            self.runtime.kv_agent.expect(transfer_id, dst[num_cached_blocks:], held)
            try:
                response = self._attempt(address, message, watch, deadline_s)
                metrics.PREFILL_ATTEMPTS.labels("ok").inc()
                return response
            except AttemptFailedError as e:
                errors.append(f"{address}: {e}")
                metrics.PREFILL_ATTEMPTS.labels("failed").inc()
                log.warning("%s: prefill on %s failed: %s", rid, address, e)
                retrying = attempt + 1 < len(targets) and time.monotonic() < deadline_s
                self._fence(rid, transfer_id, address, retrying)
            except BaseException:
                self._fence(rid, transfer_id, address, retrying=False)
                raise
        if time.monotonic() >= deadline_s:
            raise DeadlineExceededError("prefill deadline passed: " + "; ".join(errors))
        raise PrefillFailedError(
            "prefill failed on every worker tried: " + "; ".join(errors or ["no prefill worker"])
        )

    def _attempt(
        self, address: str, message: wpb.PrefillRequest, watch: PrefillWatch, deadline_s: float
    ) -> wpb.PrefillResponse:
        remaining_s = deadline_s - time.monotonic()
        if remaining_s <= 0:
            raise DeadlineExceededError("prefill deadline passed before an attempt could start")
        try:
            future = self._stub(address).Prefill.future(message, timeout=remaining_s)
            response = watch.call(future, remaining_s)
        except grpc.RpcError as e:
            code = e.code()
            if code == grpc.StatusCode.INVALID_ARGUMENT:  # another worker would say the same
                raise InvalidRequestError(f"prefill rejected the request: {e.details()}") from e
            if code == grpc.StatusCode.DEADLINE_EXCEEDED:
                raise DeadlineExceededError(f"prefill on {address}: {e.details()}") from e
            raise AttemptFailedError(f"{code.name} {e.details()}") from e
        try:
            self.runtime.kv_agent.wait(message.request_id, max(0.0, deadline_s - time.monotonic()))
        except kvtransfer.KVTransferError as e:
            raise AttemptFailedError(str(e)) from e
        return response

    def _fence(self, rid: str, transfer_id: str, address: str, retrying: bool) -> None:
        """After a failed attempt: stop its writer; blocks it may still write into are
        quarantined (replaced by fresh ones when another attempt follows)."""
        if self.loop.error is not None:
            return  # the engine is gone, and this process with it
        fence = self.runtime.kv_agent.cancel(transfer_id)
        if fence.is_done():
            return
        if retrying:
            unfenced = self.loop.call(lambda: self.engine.replace_remote_blocks(rid))
        else:
            unfenced = self.loop.call(lambda: self.engine.abort_remote_prefill(rid, False))
        self.unfenced_writers.watch(unfenced, fence, address)

    def _on_engine_death(self, error: BaseException) -> None:
        with self._lock:
            watches = list(self._watches.values())
        for watch in watches:
            watch.interrupt(error if isinstance(error, EngineDiedError) else EngineDiedError(error))

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
        with self._lock:
            if address not in self._channels:
                channel = open_channel(
                    address, self.runtime.settings.tls, keepalive.CHANNEL_OPTIONS
                )
                self._channels[address] = worker_pb2_grpc.PrefillStub(channel)
            return self._channels[address]

    def _usage(
        self, reserved: Request, prefill: wpb.PrefillResponse | None, num_output_tokens: int,
        prefill_here: bool,
    ) -> pb.Usage:  # fmt: skip
        """The prompt once (sample 0's prefix hits), the output tokens of every sample."""
        cached = reserved.num_cached_tokens if prefill_here else 0
        return pb.Usage(
            prompt_tokens=reserved.num_prompt_tokens,
            completion_tokens=num_output_tokens,
            # Not computed: the prefill worker's own hits and what it read from ours.
            cached_prompt_tokens=(
                prefill.num_prefix_hit_tokens + prefill.num_peer_fetched_tokens
                if prefill
                else cached
            ),
        )


def _local_ttft(request: wpb.DecodeRequest, local: Request, received_s: float) -> pb.TtftBreakdown:
    """A prompt prefilled here: its queue from the call's arrival (the wait for the engine
    thread's step in progress included) to its first scheduled chunk, its chunks to its first
    token, and that token's way to this message. The engine stamps both with time.monotonic
    before the token reaches this thread."""
    scheduled_s = local.first_scheduled_time_s or received_s
    first_token_s = local.first_token_time_s or scheduled_s
    return pb.TtftBreakdown(
        router_queue_s=request.router_queue_s,
        prefill_queue_s=max(0.0, scheduled_s - received_s),
        prefill_compute_s=max(0.0, first_token_s - scheduled_s),
        first_token_emit_s=max(0.0, time.monotonic() - first_token_s),
    )


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
