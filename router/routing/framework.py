"""The routing framework: filters drop workers that cannot take a request, weighted scorers
give each survivor a cost (lower is better), and a picker chooses among them."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from router.routing.filters import PrefillBudget
from router.routing.pickers import LowestCost
from router.routing.ranking import Ranking
from router.ticket import Ticket
from router.workers import RoleViews, WorkerView


class Filter(Protocol):
    def keep(self, worker: WorkerView, ticket: Ticket) -> bool: ...


class Scorer(Protocol):
    def costs(self, workers: Sequence[WorkerView], ticket: Ticket) -> list[float]:
        """One cost per worker; scorers see all candidates so they can normalise."""
        ...


@runtime_checkable
class OwnCostScorer(Protocol):
    """A scorer whose cost for a worker is decided by that worker's view alone (not by the
    request or the other candidates): such costs can be kept in order (ranking.py)."""

    def costs(self, workers: Sequence[WorkerView], ticket: Ticket) -> list[float]: ...
    def cost(self, worker: WorkerView) -> float: ...


class Picker(Protocol):
    def pick(
        self, workers: Sequence[WorkerView], costs: Sequence[float], ticket: Ticket
    ) -> WorkerView: ...


@dataclass(frozen=True, slots=True)
class Policy:
    filters: tuple[Filter, ...]
    scorers: tuple[tuple[float, Scorer], ...]  # (weight, scorer)
    picker: Picker
    # Its choice can be read from a ranking (ranking.py): it picks the cheapest and every cost
    # is the worker's own. Worked out once: a protocol isinstance check is slow.
    _ranked: bool = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        ranked = isinstance(self.picker, LowestCost) and all(
            isinstance(scorer, OwnCostScorer) for _, scorer in self.scorers
        )
        object.__setattr__(self, "_ranked", ranked)

    def choose(self, workers: Sequence[WorkerView], ticket: Ticket) -> WorkerView | None:
        """The chosen worker, or None when no worker can take the request now."""
        ranking = self._ranking(workers)
        if ranking is not None:  # the cheapest within the budget, if the other filters agree
            cheapest = ranking.cheapest(ticket)
            if cheapest is None or all(f.keep(cheapest, ticket) for f in self.filters):
                return cheapest
        candidates = [w for w in workers if all(f.keep(w, ticket) for f in self.filters)]
        if not candidates:
            return None
        costs = [0.0] * len(candidates)
        for weight, scorer in self.scorers:
            for i, cost in enumerate(scorer.costs(candidates, ticket)):
                costs[i] += weight * cost
        return self.picker.pick(candidates, costs, ticket)

    def _ranking(self, workers: Sequence[WorkerView]) -> Ranking | None:
        """The role's workers in this policy's cost order, when its choice can be read from
        one."""
        if not self._ranked or not isinstance(workers, RoleViews):
            return None
        budget = next((f for f in self.filters if isinstance(f, PrefillBudget)), None)
        return workers.index(self, lambda: Ranking(self._own_cost, budget))

    def _own_cost(self, worker: WorkerView) -> float:
        cost = 0.0  # summed as choose() sums a candidate's costs, so the order is the same
        for weight, scorer in self.scorers:
            cost += weight * scorer.cost(worker)  # type: ignore[attr-defined]
        return cost
