"""The router's own assignments per worker, which correct the registry's stale load numbers.

A worker's heartbeat, published at time u, already counts the assignments that were active at
u. What the router changed since then is own(now) - own(u), so the best estimate of the load is
    reported + own(now) - own(u),
never less than own(now) (this router's work is there whatever the heartbeat says). Other
routers' work is what remains of `reported`. Times are wall-clock, as heartbeats carry them.
"""

from __future__ import annotations

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

    def active_at(self, t: float) -> bool:
        return self.started_at <= t and (self.ended_at is None or self.ended_at > t)


@dataclass(frozen=True, slots=True)
class Share:
    amount: int = 0
    count: int = 0


@dataclass(slots=True)
class Ledger:
    # An ended assignment matters only to heartbeats sent before it ended; it is dropped once a
    # newer heartbeat is in, or after this long for a worker that stopped sending them.
    retention_s: float = 60.0
    clock: Callable[[], float] = time.time
    _by_worker: dict[str, list[Assignment]] = field(default_factory=dict)

    def add(self, worker_id: str, amount: int, count: int = 1) -> Assignment:
        assignment = Assignment(worker_id, amount, self.clock(), count=count)
        self._by_worker.setdefault(worker_id, []).append(assignment)
        return assignment

    def end(self, assignment: Assignment) -> None:
        if assignment.ended_at is None:
            assignment.ended_at = self.clock()
        self._prune(assignment.worker_id, self.clock() - self.retention_s)

    def share(self, worker_id: str, at: float | None = None) -> Share:
        """This router's assignments on the worker that are active now (or were at `at`)."""
        t = self.clock() if at is None else at
        active = [a for a in self._by_worker.get(worker_id, ()) if a.active_at(t)]
        return Share(sum(a.amount for a in active), sum(a.count for a in active))

    def corrected(self, worker_id: str, reported: Share, reported_at: float) -> Share:
        self._prune(worker_id, reported_at)
        now, then = self.share(worker_id), self.share(worker_id, reported_at)
        return Share(
            max(now.amount, reported.amount + now.amount - then.amount),
            max(now.count, reported.count + now.count - then.count),
        )

    def _prune(self, worker_id: str, ended_before: float) -> None:
        assignments = self._by_worker.get(worker_id, [])
        kept = [a for a in assignments if a.ended_at is None or a.ended_at > ended_before]
        if kept:
            self._by_worker[worker_id] = kept
        else:
            self._by_worker.pop(worker_id, None)
