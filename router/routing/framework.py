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


@runtime_checkable
class PrefixScorer(Protocol):
    """A scorer that credits a few workers for this request (those caching its prefix) and
    costs every other one exactly 0."""

    def costs(self, workers: Sequence[WorkerView], ticket: Ticket) -> list[float]: ...
    def credited_ids(self, ticket: Ticket) -> set[str] | None:
        """The workers it may credit; None: it may credit any."""
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
    # Its choice can be read from a ranking (ranking.py): it picks the cheapest, and every cost
    # is the worker's own or a prefix scorer's. Worked out once: protocol isinstance is slow.
    _ranked: bool = field(init=False, repr=False, compare=False)
    _own_scorers: tuple[tuple[float, OwnCostScorer], ...] = field(
        init=False, repr=False, compare=False
    )
    _prefix_scorers: tuple[PrefixScorer, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        own = tuple((w, s) for w, s in self.scorers if isinstance(s, OwnCostScorer))
        prefix = tuple(
            s
            for _, s in self.scorers
            if isinstance(s, PrefixScorer) and not isinstance(s, OwnCostScorer)
        )
        ranked = isinstance(self.picker, LowestCost) and len(own) + len(prefix) == len(self.scorers)
        object.__setattr__(self, "_ranked", ranked)
        object.__setattr__(self, "_own_scorers", own)
        object.__setattr__(self, "_prefix_scorers", prefix)

    def choose(self, workers: Sequence[WorkerView], ticket: Ticket) -> WorkerView | None:
        """The chosen worker, or None when no worker can take the request now."""
        candidates = self._ranked_candidates(workers, ticket)
        if candidates is None:
            candidates = [w for w in workers if self._keeps(w, ticket)]
        if not candidates:
            return None
        costs = [0.0] * len(candidates)
        for weight, scorer in self.scorers:
            for i, cost in enumerate(scorer.costs(candidates, ticket)):
                costs[i] += weight * cost
        return self.picker.pick(candidates, costs, ticket)

    def _keeps(self, worker: WorkerView, ticket: Ticket) -> bool:
        return all(f.keep(worker, ticket) for f in self.filters)

    def _ranked_candidates(
        self, workers: Sequence[WorkerView], ticket: Ticket
    ) -> list[WorkerView] | None:
        """A few candidates the cheapest of all is among, or None to score them all: the
        cheapest by the workers' own costs within the prefill budget (if the other filters
        keep it), and the workers the prefix scorers credit, which alone can undercut it."""
        if not self._ranked or not isinstance(workers, RoleViews):
            return None
        cheapest = workers.index(self, self._new_ranking).cheapest(ticket)
        if cheapest is None:
            return []
        if not self._keeps(cheapest, ticket):
            return None
        credited: set[str] = set()
        for scorer in self._prefix_scorers:
            ids = scorer.credited_ids(ticket)
            if ids is None:
                return None
            credited |= ids
        credited.discard(cheapest.worker_id)
        views = (workers.get(worker_id) for worker_id in credited)
        return [cheapest, *(v for v in views if v is not None and self._keeps(v, ticket))]

    def _new_ranking(self) -> Ranking:
        budget = next((f for f in self.filters if isinstance(f, PrefillBudget)), None)
        return Ranking(self._own_cost, budget)

    def _own_cost(self, worker: WorkerView) -> float:
        """The worker's cost with no prefix credited: summed as choose() sums a candidate's
        costs, a prefix scorer's exact 0 left out, so it is the same float."""
        cost = 0.0
        for weight, scorer in self._own_scorers:
            cost += weight * scorer.cost(worker)
        return cost
