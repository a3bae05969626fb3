"""Pickers: the final choice among candidate workers."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from router.ticket import Ticket
from router.workers import WorkerView


@dataclass(frozen=True, slots=True)
class LowestCost:
    """The cheapest worker; ties go to the lowest worker id, so choices are reproducible."""

    def pick(
        self, workers: Sequence[WorkerView], costs: Sequence[float], ticket: Ticket
    ) -> WorkerView:
        return min(zip(costs, workers, strict=True), key=_cost_order)[1]


def one_of_cheapest(
    workers: Sequence[WorkerView], costs: Sequence[float], ticket: Ticket, n: int
) -> WorkerView:
    """One of the n cheapest (ties to the lower worker id), chosen by rendezvous hashing of
    the request's id: the same request always gets the same one, and requests spread evenly
    over them."""
    ranked = sorted(zip(costs, workers, strict=True), key=_cost_order)
    return _rendezvous(ticket.request_id.encode(), [w for _, w in ranked[:n]])


def _cost_order(cost_worker: tuple[float, WorkerView]) -> tuple[float, str]:
    """Cheapest first, ties to the lowest worker id, so choices are reproducible."""
    cost, worker = cost_worker
    return cost, worker.worker_id


def _rendezvous(key: bytes, workers: Iterable[WorkerView]) -> WorkerView:
    """The worker the key hashes highest with: a worker joining or leaving moves only the
    keys that hashed to it."""
    return max(workers, key=lambda w: hashlib.blake2b(key + w.worker_id.encode()).digest())


@dataclass(slots=True)
class RoundRobin:
    """Each candidate in turn, ignoring load (a baseline)."""

    _next: int = 0

    def pick(
        self, workers: Sequence[WorkerView], costs: Sequence[float], ticket: Ticket
    ) -> WorkerView:
        chosen = sorted(workers, key=lambda w: w.worker_id)[self._next % len(workers)]
        self._next += 1
        return chosen


@dataclass(frozen=True, slots=True)
class PrefixHash:
    """Rendezvous hashing of the prompt's leading tokens (a baseline with prefix-cache
    affinity): the same prefix goes to the same worker, and a worker joining or leaving moves
    only the prefixes that hashed to it."""

    def pick(
        self, workers: Sequence[WorkerView], costs: Sequence[float], ticket: Ticket
    ) -> WorkerView:
        return _rendezvous(ticket.affinity_key, workers)
