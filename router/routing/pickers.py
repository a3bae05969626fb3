"""Pickers: the final choice among candidate workers."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

from router.ticket import Ticket
from router.workers import WorkerView


@dataclass(frozen=True, slots=True)
class LowestCost:
    """The cheapest worker; ties go to the lowest worker id, so choices are reproducible."""

    def pick(
        self, workers: Sequence[WorkerView], costs: Sequence[float], ticket: Ticket
    ) -> WorkerView:
        return min(zip(costs, workers, strict=True), key=lambda cw: (cw[0], cw[1].worker_id))[1]


def one_of_cheapest(
    workers: Sequence[WorkerView], costs: Sequence[float], ticket: Ticket, n: int
) -> WorkerView:
    """One of the n cheapest (ties to the lower worker id), chosen by rendezvous hashing of
    the request's id: the same request always gets the same one, and requests spread evenly
    over them."""
    ranked = sorted(zip(costs, workers, strict=True), key=lambda cw: (cw[0], cw[1].worker_id))

    def weight(worker: WorkerView) -> bytes:
        return hashlib.blake2b(ticket.request_id.encode() + worker.worker_id.encode()).digest()

    return max((w for _, w in ranked[:n]), key=weight)


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
        def weight(worker: WorkerView) -> bytes:
            return hashlib.blake2b(ticket.affinity_key + worker.worker_id.encode()).digest()

        return max(workers, key=weight)
