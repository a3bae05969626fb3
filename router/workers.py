"""The worker pools as this router sees them: the registry's snapshot, refreshed in the
background, with each worker's load corrected by the router's own assignments (ledger.py).

Views are kept, not computed per request: a worker's view is rebuilt when its registry entry
changes or the router assigns it work or releases some, and each role's totals and indexes
(RoleViews.index) follow the views that changed. A request then costs the same whatever the
number of workers."""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Protocol, TypeVar, overload

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
    tokens_per_s: float  # prefill: measured throughput, else its role's mean (_view)
    free_blocks: int  # decode: KV blocks free (cached-but-unused ones count as free)
    total_blocks: int
    running_requests: int  # decode: requests in the batch
    # Prefill side, with router replicas: this router placed work here that its peers have not
    # been told of yet, and places no more until they have (router/replicas.py).
    fenced: bool = False

    @property
    def worker_id(self) -> str:
        return self.info.worker_id

    @property
    def address(self) -> str:
        return self.info.address


class ViewIndex(Protocol):
    """Something derived from one role's views, told of every view that changes."""

    def changed(self, old: WorkerView | None, new: WorkerView | None) -> None: ...


Index = TypeVar("Index", bound=ViewIndex)


class RoleViews(Sequence[WorkerView]):
    """One role's views in worker-id order, with running totals over them and the indexes
    routing and admission keep on them."""

    def __init__(self) -> None:
        self._views: dict[str, WorkerView] = {}
        self._ordered: tuple[WorkerView, ...] | None = ()  # None: rebuilt when next read
        # (id(owner), name) -> (owner, index)
        self._indexes: dict[tuple[int, str], tuple[object, ViewIndex]] = {}
        self.queued_tokens = 0
        self.free_blocks = 0
        self.total_blocks = 0
        self._num_by_total_blocks: Counter[int] = Counter()
        # The prefill speeds the workers have measured, summed in whole milli-tokens/s (an
        # integer sum is the same whatever order workers came and went in) and counted; and the
        # ids of those that have not measured yet, whose views take assumed_tokens_per_s.
        self._measured_milli = 0
        self._num_measured = 0
        self.unmeasured: set[str] = set()

    def get(self, worker_id: str) -> WorkerView | None:
        return self._views.get(worker_id)

    def largest_total_blocks(self) -> int:
        return max(self._num_by_total_blocks, default=0)

    def one_kv_size(self) -> bool:
        """Every worker has the same number of KV blocks."""
        return len(self._num_by_total_blocks) == 1

    def assumed_tokens_per_s(self) -> float | None:
        """The speed a worker that has not measured its own is taken to have: the mean its
        role's workers have measured, to two significant figures (None: none has yet). A
        guess needs no more, and the views that take it follow it only when it moves that
        much, a few times while a fleet warms up, not on every heartbeat."""
        if not self._num_measured:
            return None
        return float(f"{self._measured_milli / self._num_measured / 1000:.2g}")

    def all_report_capacity(self) -> bool:
        """Every worker has reported its KV blocks (one with 0 has not yet)."""
        return not any(size <= 0 for size in self._num_by_total_blocks)

    def index(self, owner: object, build: Callable[[], Index], name: str = "") -> Index:
        """owner's index of these views (one of its several, by name), built (and told of
        every view) on first use."""
        kept = self._indexes.get((id(owner), name))
        if kept is None:
            index = build()
            for view in self._views.values():
                index.changed(None, view)
            kept = self._indexes[id(owner), name] = (owner, index)  # the owner is kept alive
        return kept[1]  # type: ignore[return-value]

    def put(self, worker_id: str, view: WorkerView | None) -> None:
        """Replaces the worker's view (None: the worker left)."""
        old = self._views.pop(worker_id, None)
        if view is not None:
            self._views[worker_id] = view
        if old is not None:
            self._count(old, -1)
        if view is not None:
            self._count(view, 1)
        self._ordered = None
        for _, index in self._indexes.values():
            index.changed(old, view)

    def _count(self, view: WorkerView, sign: int) -> None:
        self.queued_tokens += sign * view.queued_tokens
        self.free_blocks += sign * view.free_blocks
        self.total_blocks += sign * view.total_blocks
        counts = self._num_by_total_blocks
        counts[view.total_blocks] += sign
        if counts[view.total_blocks] == 0:
            del counts[view.total_blocks]
        if (measured := view.info.load.prefill_tokens_per_s) > 0:
            self._measured_milli += sign * round(measured * 1000)
            self._num_measured += sign
        elif sign > 0:
            self.unmeasured.add(view.worker_id)
        else:
            self.unmeasured.discard(view.worker_id)

    def _in_order(self) -> tuple[WorkerView, ...]:
        if self._ordered is None:
            self._ordered = tuple(self._views[k] for k in sorted(self._views))
        return self._ordered

    def __len__(self) -> int:
        return len(self._views)

    def __iter__(self) -> Iterator[WorkerView]:
        return iter(self._in_order())

    @overload
    def __getitem__(self, i: int) -> WorkerView: ...
    @overload
    def __getitem__(self, i: slice) -> Sequence[WorkerView]: ...
    def __getitem__(self, i: int | slice) -> WorkerView | Sequence[WorkerView]:
        return self._in_order()[i]

    def __repr__(self) -> str:
        return f"RoleViews({list(self._in_order())!r})"


@dataclass(slots=True)
class WorkerPool:
    """An aggregated worker is both sides at once: its prompt tokens are held in the prefill
    ledger and its KV blocks in the decode ledger, under its own worker id."""

    default_tokens_per_s: float
    _infos: dict[Role, dict[str, WorkerInfo]] = field(
        default_factory=lambda: {r: {} for r in ROLES}
    )
    _views: dict[Role, RoleViews] = field(default_factory=lambda: {r: RoleViews() for r in ROLES})
    ledgers: dict[Role, Ledger] = field(
        default_factory=lambda: {"prefill": Ledger(), "decode": Ledger()}
    )

    # The KV block size of the workers that hold decode KV (what a request's KV hold is counted
    # in, and its prompt hashed at): the one most of them registered with, the smaller on a tie.
    # Workers that registered another one get no prefix matches. Set by update(), not per request.
    block_size: int = UNREGISTERED_BLOCK_SIZE
    # The smallest context among the registered workers (None: none is); set by update().
    max_model_len: int | None = None
    # Entries a Redis restart lost, kept until their TTLs pass (refresh()), by role and id.
    _carried: dict[Role, dict[str, WorkerInfo]] = field(
        default_factory=lambda: {r: {} for r in ROLES}
    )
    _registry_run_id: str | None = None
    clock: Callable[[], float] = time.time  # wall-clock, as the entries' times are
    # Called with each assignment as it starts and ends (router replicas tell each other of
    # them: replicas.py).
    on_assign: Callable[[Role, Assignment], None] | None = None
    # With peers to tell: a prefill-side worker given work is fenced until they are told.
    fencing: bool = False
    # The routers placing on these workers, this one included, as far as it hears (replicas.py):
    # placement spreads its choices over that many of the cheapest (Policy.choose).
    num_routers: int = 1
    fenced: set[str] = field(default_factory=set)

    def update(self, role: Role, infos: list[WorkerInfo]) -> None:
        current, fresh = self._infos[role], {info.worker_id: info for info in infos}
        for worker_id in current.keys() - fresh.keys():
            del current[worker_id]
            self._put(role, worker_id, None)
        for worker_id, info in fresh.items():
            if current.get(worker_id) != info:
                current[worker_id] = info
                self._rebuild(role, worker_id)
        sizes = [
            w.block_size for side in ("decode", "aggregated") for w in self._infos[side].values()
        ]
        self.block_size = (
            min(set(sizes), key=lambda size: (-sizes.count(size), size))
            if sizes
            else UNREGISTERED_BLOCK_SIZE
        )
        lengths = [w.max_model_len for side in ROLES for w in self._infos[side].values()]
        self.max_model_len = min(lengths, default=None)

    async def refresh(self, registry: Registry) -> None:
        """Follows the registry. A Redis restart loses every entry at once while the workers
        live on (each publishes again within a third of its TTL): the entries it lost are kept
        until their own TTLs pass, so the restart is invisible to clients."""
        run_id = await asyncio.to_thread(registry.run_id)
        restarted = self._registry_run_id not in (None, run_id)
        self._registry_run_id = run_id
        now = self.clock()
        for role in ROLES:
            fresh = await asyncio.to_thread(registry.workers, role)
            carried = self._carried[role]
            if restarted:
                carried.update(self._infos[role])
            for info in fresh:
                carried.pop(info.worker_id, None)
            for worker_id in [w for w, i in carried.items() if i.updated_at + i.ttl_s <= now]:
                del carried[worker_id]
            self.update(role, fresh + list(carried.values()))

    def serving(self) -> bool:
        """A whole request can be served: a prefill and a decode worker, or an aggregated one."""
        return self.has("aggregated") or (self.has("prefill") and self.has("decode"))

    def has(self, role: Role) -> bool:
        return bool(self._infos[role])

    def worker_ids(self) -> set[str]:
        return {worker_id for infos in self._infos.values() for worker_id in infos}

    def infos(self, role: Role) -> list[WorkerInfo]:
        return [view.info for view in self._views[role]]

    def views(self, role: Role) -> tuple[WorkerView, ...]:
        """The role's views in worker-id order, as they are now."""
        return tuple(self._views[role])

    def role_views(self, role: Role) -> RoleViews:
        """The role's kept views, with their totals and indexes: what placement reads."""
        return self._views[role]

    def assign(self, side: Role, worker_id: str, amount: int, count: int = 1) -> Assignment:
        """side: "prefill" (prompt tokens) or "decode" (KV blocks, count: sequences)."""
        return self.assign_request((side, worker_id, amount, count))[side]

    def assign_request(self, *holds: tuple[Role, str, int, int]) -> dict[Role, Assignment]:
        """A request's holds, (side, worker id, amount, count) each, taken together: a worker
        holding both sides (an aggregated one) has its views rebuilt once, not per side."""
        assignments = {
            side: self.ledgers[side].add(w, amount, count) for side, w, amount, count in holds
        }
        if self.fencing and "prefill" in assignments:
            self.fenced.add(assignments["prefill"].worker_id)
        for worker_id in dict.fromkeys(a.worker_id for a in assignments.values()):
            self._rebuild_views(worker_id)
        if self.on_assign is not None:
            for side, assignment in assignments.items():
                self.on_assign(side, assignment)
        return assignments

    def release(self, side: Role, assignment: Assignment) -> None:
        self.ledgers[side].end(assignment)
        self._rebuild_views(assignment.worker_id)
        if self.on_assign is not None:
            self.on_assign(side, assignment)

    def set_peer(self, side: Role, peer: str, assignments: list[Assignment]) -> None:
        """Replaces what is known of another router replica's assignments on one side."""
        for worker_id in self.ledgers[side].set_peer(peer, assignments):
            self._rebuild_views(worker_id)

    def update_peer(self, side: Role, peer: str, assignments: list[Assignment]) -> None:
        """Another router replica's assignments on one side that started or ended."""
        for worker_id in self.ledgers[side].update_peer(peer, assignments):
            self._rebuild_views(worker_id)

    def unfence(self, worker_ids: set[str]) -> None:
        """The peers have been told of the work on these workers (or cannot be told)."""
        for worker_id in worker_ids & self.fenced:
            self.fenced.discard(worker_id)
            self._rebuild_views(worker_id)

    def _rebuild_views(self, worker_id: str) -> None:
        """After a ledger change on either side: the worker's view, whatever its role (an
        aggregated worker holds both sides, and so does a decode worker given prompts to
        compute, AdmissionSettings.prefill_overflow)."""
        for role in ROLES:
            if worker_id in self._infos[role]:
                self._rebuild(role, worker_id)

    def _rebuild(self, role: Role, worker_id: str) -> None:
        self._put(role, worker_id, self._view(role, self._infos[role][worker_id]))

    def _put(self, role: Role, worker_id: str, view: WorkerView | None) -> None:
        """Replaces a worker's view; the views that take the role's assumed speed follow it
        when that moved. Placement rebuilds a view on every assignment and release, so the
        speed is read only while some view takes it; when none did before the put (nan: no
        speed equals it), any that does after it is rebuilt, the one just put among them: its
        view counted its own measured speed if it had one until now (a restarted worker)."""
        views = self._views[role]
        before = views.assumed_tokens_per_s() if views.unmeasured else math.nan
        views.put(worker_id, view)
        if views.unmeasured and views.assumed_tokens_per_s() != before:
            for other in tuple(views.unmeasured):  # put() takes each out and back in
                views.put(other, self._view(role, self._infos[role][other]))

    def _view(self, role: Role, info: WorkerInfo) -> WorkerView:
        load = info.load
        # A worker that has not measured its speed yet (it has prefilled nothing) is taken to
        # be as fast as those of its role that have: the configured default, a guess, made a
        # fresh worker look slower or faster than its peers, and a fetched prefix on it count
        # for more than the cached one on a measured holder (PrefillSaved divides by it).
        tokens_per_s = (
            load.prefill_tokens_per_s
            or self._views[role].assumed_tokens_per_s()
            or self.default_tokens_per_s
        )
        # Corrected on both sides; it prefills only what waits. A decode worker too: the
        # prompts it was given to compute itself are on its prefill side.
        if role in ("aggregated", "decode"):
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
                info.worker_id in self.fenced,
            )  # fmt: skip
        reported = Share(load.queued_tokens, load.waiting_requests + load.running_requests)
        queued = self.ledgers["prefill"].corrected(info.worker_id, reported, info.updated_at)
        return WorkerView(
            info, queued.amount, queued.count, tokens_per_s, load.free_blocks,
            load.total_blocks, load.running_requests, info.worker_id in self.fenced,
        )  # fmt: skip
