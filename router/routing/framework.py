"""The routing framework: filters drop workers that cannot take a request, weighted scorers
give each survivor a cost (lower is better), and a picker chooses among them."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from router.ticket import Ticket
from router.workers import WorkerView


class Filter(Protocol):
    def keep(self, worker: WorkerView, ticket: Ticket) -> bool: ...


class Scorer(Protocol):
    def costs(self, workers: Sequence[WorkerView], ticket: Ticket) -> list[float]:
        """One cost per worker; scorers see all candidates so they can normalise."""
        ...


class Picker(Protocol):
    def pick(
        self, workers: Sequence[WorkerView], costs: Sequence[float], ticket: Ticket
    ) -> WorkerView: ...


@dataclass(frozen=True, slots=True)
class Policy:
    filters: tuple[Filter, ...]
    scorers: tuple[tuple[float, Scorer], ...]  # (weight, scorer)
    picker: Picker

    def choose(self, workers: Sequence[WorkerView], ticket: Ticket) -> WorkerView | None:
        """The chosen worker, or None when no worker can take the request now."""
        candidates = [w for w in workers if all(f.keep(w, ticket) for f in self.filters)]
        if not candidates:
            return None
        costs = [0.0] * len(candidates)
        for weight, scorer in self.scorers:
            for i, cost in enumerate(scorer.costs(candidates, ticket)):
                costs[i] += weight * cost
        return self.picker.pick(candidates, costs, ticket)
