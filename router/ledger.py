"""The router's own assignments per worker, which correct the registry's stale load numbers.

A worker's heartbeat, published at time u, already counts the assignments that were active at
u. What the routers changed since then is routed(now) - routed(u), so the best estimate of the
load is
    reported + routed(now) - routed(u),
never less than routed(now) (the routers' work is there whatever the heartbeat says). `routed`
is this router's assignments and, with several router replicas, the others' as last heard
(router/replicas.py): each peer's kept assignments replace what was known of it, and count as
this router's own do. Times are wall-clock, as heartbeats carry them.

Both shares are running totals, so a correction costs O(1): own(now) changes with each
assignment and its end; own(u) is summed once per heartbeat time u and then kept up to date
as assignments start, end and are dropped. The ledger's clock is taken never to go back, so
the assignments active now are exactly those not yet ended.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass(slots=True)
class Assignment:
    worker_id: str
    amount: int  # prefill: prompt tokens; decode: KV blocks
    started_at: float
    ended_at: float | None = None
    count: int = 1  # requests; decode: sequences (a request with n samples runs n)
    owner: str = ""  # the router replica that made it ("": this one)
    serial: int = 0  # its number in its owner's ledger: how the owner's peers name it

    def active_at(self, t: float) -> bool:
        return self.started_at <= t and (self.ended_at is None or self.ended_at > t)


@dataclass(frozen=True, slots=True)
class Share:
    amount: int = 0
    count: int = 0


@dataclass(slots=True)
class _Total:
    amount: int = 0
    count: int = 0

    def add(self, assignment: Assignment, sign: int = 1) -> None:
        self.amount += sign * assignment.amount
        self.count += sign * assignment.count

    def share(self) -> Share:
        return Share(self.amount, self.count)


@dataclass(slots=True)
class _WorkerAssignments:
    """One worker's kept assignments: every active one, and the ended ones a heartbeat may
    still count."""

    kept: list[Assignment] = field(default_factory=list)
    now: _Total = field(default_factory=_Total)  # the active ones
    mine: _Total = field(default_factory=_Total)  # the active ones this router made
    then_at: float | None = None  # the heartbeat time `then` is summed at
    then: _Total = field(default_factory=_Total)  # the kept ones active at then_at
    oldest_end: float = math.inf  # of the kept ended ones: nothing to drop before it

    def counted_then(self, assignment: Assignment) -> bool:
        return self.then_at is not None and assignment.active_at(self.then_at)

    def put(self, assignment: Assignment, sign: int = 1) -> None:
        """Counts an assignment in (sign 1), or out again (-1), active or ended."""
        if assignment.ended_at is None:
            self.now.add(assignment, sign)
            if not assignment.owner:
                self.mine.add(assignment, sign)
        elif sign > 0:
            self.oldest_end = min(self.oldest_end, assignment.ended_at)
        if self.counted_then(assignment):
            self.then.add(assignment, sign)

    def start(self, assignment: Assignment) -> None:
        self.kept.append(assignment)
        self.put(assignment)

    def end(self, assignment: Assignment, at: float) -> None:
        self.put(assignment, -1)
        assignment.ended_at = at
        self.put(assignment)

    def remove_owner(self, owner: str) -> None:
        """Forgets every assignment `owner` made."""
        for a in self.kept:
            if a.owner == owner:
                self.put(a, -1)
        self.kept = [a for a in self.kept if a.owner != owner]

    def drop_ended(self, before: float) -> None:
        """Forgets the assignments that ended at or before `before`."""
        if self.oldest_end > before:
            return
        kept, self.oldest_end = [], math.inf
        for a in self.kept:
            if a.ended_at is not None and a.ended_at <= before:
                if self.counted_then(a):
                    self.then.add(a, -1)
            else:
                kept.append(a)
                if a.ended_at is not None:
                    self.oldest_end = min(self.oldest_end, a.ended_at)
        self.kept = kept

    def share_at(self, t: float) -> Share:
        if self.then_at != t:
            self.then_at, self.then = t, _Total()
            for a in self.kept:
                if a.active_at(t):
                    self.then.add(a)
        return self.then.share()


@dataclass(slots=True)
class Ledger:
    # An ended assignment matters only to heartbeats sent before it ended; it is dropped once a
    # newer heartbeat is in, or after this long for a worker that stopped sending them.
    retention_s: float = 60.0
    clock: Callable[[], float] = time.time
    _by_worker: dict[str, _WorkerAssignments] = field(default_factory=dict)

    # peer router id -> serial -> its assignment as last heard; what its next full state no
    # longer has leaves
    _peers: dict[str, dict[int, Assignment]] = field(default_factory=dict)
    _serial: int = 0

    def add(self, worker_id: str, amount: int, count: int = 1) -> Assignment:
        self._serial += 1
        assignment = Assignment(worker_id, amount, self.clock(), count=count, serial=self._serial)
        self._by_worker.setdefault(worker_id, _WorkerAssignments()).start(assignment)
        return assignment

    def own(self) -> list[Assignment]:
        """This router's kept assignments, active and ended: what its peers are told."""
        return [a for w in self._by_worker.values() for a in w.kept if not a.owner]

    def set_peer(self, peer: str, assignments: list[Assignment]) -> set[str]:
        """Replaces what is known of a peer router's assignments with its full state (each
        with `owner` = peer; none: the peer is gone). Returns the workers whose load changed:
        only theirs are touched."""
        old = self._peers.pop(peer, {})
        new = {a.serial: a for a in assignments}
        changed = {a.worker_id for serial, a in old.items() if new.get(serial) != a}
        changed |= {a.worker_id for serial, a in new.items() if old.get(serial) != a}
        for worker_id in changed:
            worker = self._by_worker.get(worker_id)
            if worker is not None:
                worker.remove_owner(peer)
        known = {serial: a for serial, a in old.items() if a.worker_id not in changed}
        for serial, a in new.items():
            if a.worker_id in changed:
                self._by_worker.setdefault(a.worker_id, _WorkerAssignments()).start(a)
                known[serial] = a
        for worker_id in changed:
            self._forget_if_empty(worker_id)
        if known:
            self._peers[peer] = known
        return changed

    def update_peer(self, peer: str, assignments: list[Assignment]) -> set[str]:
        """A peer's assignments that started or ended since its last message. Returns the
        workers whose load changed."""
        known = self._peers.setdefault(peer, {})
        changed = set()
        for a in assignments:
            old = known.get(a.serial)
            if old is None:
                self._by_worker.setdefault(a.worker_id, _WorkerAssignments()).start(a)
                known[a.serial] = a
            elif old.ended_at is None and a.ended_at is not None:  # active: still kept
                self._by_worker[old.worker_id].end(old, a.ended_at)
            else:
                continue
            changed.add(a.worker_id)
        return changed

    def peers(self) -> set[str]:
        return set(self._peers)

    def end(self, assignment: Assignment) -> None:
        worker = self._by_worker.get(assignment.worker_id)
        if worker is None:  # ended long ago: dropped with its worker's history
            return
        if assignment.ended_at is None:
            worker.end(assignment, self.clock())
        self._drop_ended(assignment.worker_id, self.clock() - self.retention_s)

    def share(self, worker_id: str) -> Share:
        """This router's assignments on the worker that are active now."""
        worker = self._by_worker.get(worker_id)
        return Share() if worker is None else worker.mine.share()

    def routed(self, worker_id: str) -> Share:
        """Every router's assignments on the worker active now (the peers' as last heard)."""
        worker = self._by_worker.get(worker_id)
        return Share() if worker is None else worker.now.share()

    def corrected(self, worker_id: str, reported: Share, reported_at: float) -> Share:
        self._drop_ended(worker_id, reported_at)
        worker = self._by_worker.get(worker_id)
        if worker is None:
            return Share(max(0, reported.amount), max(0, reported.count))
        now, then = worker.now, worker.share_at(reported_at)
        return Share(
            max(now.amount, reported.amount + now.amount - then.amount),
            max(now.count, reported.count + now.count - then.count),
        )

    def _drop_ended(self, worker_id: str, before: float) -> None:
        worker = self._by_worker.get(worker_id)
        if worker is None:
            return
        worker.drop_ended(before)
        self._forget_if_empty(worker_id)

    def _forget_if_empty(self, worker_id: str) -> None:
        worker = self._by_worker.get(worker_id)
        if worker is not None and not worker.kept:
            del self._by_worker[worker_id]
