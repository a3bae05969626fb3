"""The worker pools as this router sees them: the registry's snapshot, refreshed in the
background, with each worker's load corrected by the router's own assignments (ledger.py)."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field

from pdserve.registry import ROLES, Registry, Role, WorkerInfo
from router.ledger import Assignment, Ledger, Share

log = logging.getLogger(__name__)

# The KV block size before any decode-side worker has registered (the engine's default); no
# request is admitted then anyway.
UNREGISTERED_BLOCK_SIZE = 16


@dataclass(frozen=True, slots=True)
class WorkerView:
    """One worker's effective load at this moment: what routing and admission decide on."""

    info: WorkerInfo
    queued_tokens: int  # prefill: prompt tokens waiting or being prefilled
    queued_requests: int  # prefill: requests waiting or being prefilled
    tokens_per_s: float  # prefill: measured throughput, or the configured default
    free_blocks: int  # decode: KV blocks free (cached-but-unused ones count as free)
    total_blocks: int
    running_requests: int  # decode: requests in the batch

    @property
    def worker_id(self) -> str:
        return self.info.worker_id

    @property
    def address(self) -> str:
        return self.info.address


@dataclass(slots=True)
class WorkerPool:
    """An aggregated worker is both sides at once: its prompt tokens are held in the prefill
    ledger and its KV blocks in the decode ledger, under its own worker id."""

    default_tokens_per_s: float
    _infos: dict[Role, list[WorkerInfo]] = field(default_factory=lambda: {r: [] for r in ROLES})
    ledgers: dict[Role, Ledger] = field(
        default_factory=lambda: {"prefill": Ledger(), "decode": Ledger()}
    )

    # The KV block size of the workers that hold decode KV (what a request's KV hold is counted
    # in, and its prompt hashed at): the one most of them registered with, the smaller on a tie.
    # Workers that registered another one get no prefix matches. Set by update(), not per request.
    block_size: int = UNREGISTERED_BLOCK_SIZE

    def update(self, role: Role, infos: list[WorkerInfo]) -> None:
        self._infos[role] = sorted(infos, key=lambda w: w.worker_id)
        sizes = [w.block_size for side in ("decode", "aggregated") for w in self._infos[side]]
        self.block_size = (
            min(set(sizes), key=lambda size: (-sizes.count(size), size))
            if sizes
            else UNREGISTERED_BLOCK_SIZE
        )

    async def refresh(self, registry: Registry) -> None:
        for role in ROLES:
            self.update(role, await asyncio.to_thread(registry.workers, role))

    def serving(self) -> bool:
        """A whole request can be served: a prefill and a decode worker, or an aggregated one."""
        infos = self._infos
        return bool(infos["aggregated"]) or bool(infos["prefill"] and infos["decode"])

    def worker_ids(self) -> set[str]:
        return {info.worker_id for infos in self._infos.values() for info in infos}

    def infos(self, role: Role) -> list[WorkerInfo]:
        return list(self._infos[role])

    def views(self, role: Role) -> list[WorkerView]:
        return [self._view(role, info) for info in self._infos[role]]

    def assign(self, side: Role, worker_id: str, amount: int, count: int = 1) -> Assignment:
        """side: "prefill" (prompt tokens) or "decode" (KV blocks, count: sequences)."""
        return self.ledgers[side].add(worker_id, amount, count)

    def release(self, side: Role, assignment: Assignment) -> None:
        self.ledgers[side].end(assignment)

    def _view(self, role: Role, info: WorkerInfo) -> WorkerView:
        load = info.load
        tokens_per_s = load.prefill_tokens_per_s or self.default_tokens_per_s
        if role == "aggregated":  # corrected on both sides; it prefills only what waits
            queued = self.ledgers["prefill"].corrected(
                info.worker_id, Share(load.queued_tokens, load.waiting_requests), info.updated_at
            )
            used = self.ledgers["decode"].corrected(
                info.worker_id, Share(load.total_blocks - load.free_blocks, load.running_requests),
                info.updated_at,
            )  # fmt: skip
            return WorkerView(
                info, queued.amount, queued.count, tokens_per_s,
                max(0, load.total_blocks - used.amount), load.total_blocks, used.count,
            )  # fmt: skip
        ledger = self.ledgers[role]
        if role == "prefill":
            reported = Share(load.queued_tokens, load.waiting_requests + load.running_requests)
            queued = ledger.corrected(info.worker_id, reported, info.updated_at)
            return WorkerView(
                info, queued.amount, queued.count, tokens_per_s, load.free_blocks,
                load.total_blocks, load.running_requests,
            )  # fmt: skip
        reported = Share(load.total_blocks - load.free_blocks, load.running_requests)
        used = ledger.corrected(info.worker_id, reported, info.updated_at)
        return WorkerView(
            info, load.queued_tokens, load.waiting_requests, tokens_per_s,
            max(0, load.total_blocks - used.amount), load.total_blocks, used.count,
        )  # fmt: skip
