"""Cross-worker prefix reuse, prefill side: read the prompt prefix the decode worker holds (its
prefix-cache hits) into our own blocks instead of computing it, when moving its KV is faster
than computing it by the measured speeds; on any failure, compute it after all."""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from dataclasses import dataclass, field

import kvtransfer
from engine.errors import EngineStoppedError
from pdserve.worker.v1 import worker_pb2 as wpb
from pdserve.worker_runtime import WorkerRuntime
from prefill_service import metrics
from prefill_service.request_path import FetchCosts, plan_prefix_fetch

log = logging.getLogger(__name__)

# A fetch is given as long as computing its tokens would take, and at least this: past it,
# computing them is the faster way after all.
MIN_FETCH_WAIT_S = 1.0


@dataclass(slots=True)
class Fetched:
    """What a fetch leaves the request: tokens now cached here, blocks held until it ends."""

    num_tokens: int = 0
    held_block_ids: list[int] = field(default_factory=list)
    seconds: float = 0.0  # spent reading (or failing to)
    looked_up: bool = False  # planned: the request's prefix lookup is counted (prefix_looked_up)


class PrefixFetcher:
    def __init__(self, runtime: WorkerRuntime) -> None:
        self.runtime = runtime
        self.engine = runtime.engine
        self.block_size = runtime.settings.engine.block_size
        layout = runtime.kv_agent.layout
        self.costs = FetchCosts(layout.bytes_per_block / layout.block_size)
        metrics.PEER_FETCH_BYTES_PER_S.set(self.costs.kv_bytes_per_s)

    def fetch(
        self, request_id: str, prompt: list[int], dest: wpb.KVDestination, deadline_s: float
    ) -> Fetched:
        """Reads the blocks the decode worker holds past our own prefix hits, when offered and
        worth it; held, they and our hits are what the request's prefix match then finds."""
        if not (self.runtime.settings.peer_fetch and dest.cached_blocks_readable):
            return Fetched()
        plan = self.runtime.loop.call(lambda: plan_prefix_fetch(
            self.engine, prompt, dest.num_cached_blocks, self.costs,
            self.runtime.loop.stats.prefill_tokens_per_s,
        ))  # fmt: skip
        if plan is None:
            return Fetched(looked_up=True)
        if plan.refused is not None:
            metrics.PEER_FETCHES.labels(plan.refused).inc()
            return Fetched(looked_up=True)
        own_ids, dst_ids = plan.own_ids, plan.dst_ids
        fetched = Fetched(held_block_ids=own_ids, looked_up=True)
        first = len(own_ids)
        src_ids = list(dest.block_ids[first : first + len(dst_ids)])
        num_tokens = len(dst_ids) * self.block_size
        wait_s = max(MIN_FETCH_WAIT_S, self._compute_s(num_tokens))
        started = time.monotonic()
        agent = self.runtime.kv_agent
        try:
            handle = agent.read(dest.agent_metadata, request_id, src_ids, dst_ids)
            handle.wait(max(0.0, min(wait_s, deadline_s - started)))
        except (kvtransfer.KVTransferError, ValueError) as e:
            log.warning("%s: reading %d prefix tokens failed (%s); computing them", request_id,
                        num_tokens, e)  # fmt: skip
            metrics.PEER_FETCHES.labels("failed").inc()
            self._free_when_fenced(agent.cancel(request_id), dst_ids, deadline_s)
            fetched.seconds = time.monotonic() - started
            return fetched
        fetched.seconds = time.monotonic() - started
        if self.costs.record(handle.num_bytes, fetched.seconds):
            metrics.PEER_FETCH_BYTES_PER_S.set(self.costs.kv_bytes_per_s)
        self.runtime.loop.call(lambda: self.engine.kv.cache_prompt_blocks(prompt, first, dst_ids))
        metrics.PEER_FETCHES.labels("ok").inc()
        fetched.num_tokens = num_tokens
        fetched.held_block_ids += dst_ids
        return fetched

    def _free_when_fenced(
        self, fence: kvtransfer.Fence, block_ids: list[int], deadline_s: float
    ) -> None:
        """The blocks of a failed read go back once its writer is fenced (at once, but for a
        NIXL holder that did not confirm: then at its fence or the request's deadline, when it
        has given up on the request too), without holding the request back."""
        if fence.is_done():
            self._free(block_ids)
            return

        def wait_then_free() -> None:
            fence.done.wait(max(0.0, deadline_s - time.monotonic()))
            self._free(block_ids)

        threading.Thread(target=wait_then_free, name="peer-fetch-fence", daemon=True).start()

    def _free(self, block_ids: list[int]) -> None:
        with contextlib.suppress(EngineStoppedError):  # the process is going away
            self.runtime.loop.post(lambda: self.engine.kv.release(block_ids))

    def _compute_s(self, num_tokens: int) -> float:
        return FetchCosts.compute_s(num_tokens, self.runtime.loop.stats.prefill_tokens_per_s)
