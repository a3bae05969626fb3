"""The routing framework: filters drop workers that cannot take a request, weighted scorers
give each survivor a cost (lower is better), and a picker chooses among them."""

from __future__ import annotations

from bisect import insort
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from router.routing.filters import KVFits, PrefillBudget
from router.routing.pickers import LowestCost, one_of_cheapest
from router.routing.ranking import Key, Ranking
from router.routing.scorers import KVUsage
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


# A walk's keys leave out KV use's request-dependent part, a shift it adds back to bound the
# costs ahead; both are float sums whose rounding is a few ulps (~1e-16 of the values), so a
# margin of 1e-9 of them keeps the bound below every cost ahead.
WALK_MARGIN = 1e-9


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
    # is the worker's own, a prefix scorer's or KV use. Worked out once: protocol isinstance is
    # slow.
    _ranked: bool = field(init=False, repr=False, compare=False)
    _own_scorers: tuple[tuple[float, OwnCostScorer], ...] = field(
        init=False, repr=False, compare=False
    )
    _prefix_scorers: tuple[PrefixScorer, ...] = field(init=False, repr=False, compare=False)
    _kv_use: tuple[tuple[float, KVUsage], ...] = field(init=False, repr=False, compare=False)
    _uncredited: tuple[tuple[float, Scorer], ...] = field(init=False, repr=False, compare=False)
    _budget: PrefillBudget | None = field(init=False, repr=False, compare=False)
    _needs_room: bool = field(init=False, repr=False, compare=False)  # it filters by KVFits

    def __post_init__(self) -> None:
        own = tuple((w, s) for w, s in self.scorers if isinstance(s, OwnCostScorer))
        prefix = tuple(
            s
            for _, s in self.scorers
            if isinstance(s, PrefixScorer) and not isinstance(s, OwnCostScorer)
        )
        kv_use = tuple((w, s) for w, s in self.scorers if isinstance(s, KVUsage) and w > 0)
        kinds = len(own) + len(prefix) + len(kv_use)
        ranked = isinstance(self.picker, LowestCost) and kinds == len(self.scorers)
        object.__setattr__(self, "_ranked", ranked)
        object.__setattr__(self, "_own_scorers", own)
        object.__setattr__(self, "_prefix_scorers", prefix)
        object.__setattr__(self, "_kv_use", kv_use)
        uncredited = tuple((w, s) for w, s in self.scorers if not any(s is p for p in prefix))
        object.__setattr__(self, "_uncredited", uncredited)
        budget = next((f for f in self.filters if isinstance(f, PrefillBudget)), None)
        object.__setattr__(self, "_budget", budget)
        object.__setattr__(self, "_needs_room", any(isinstance(f, KVFits) for f in self.filters))

    def choose(
        self, workers: Sequence[WorkerView], ticket: Ticket, spread: int = 1
    ) -> WorkerView | None:
        """The chosen worker, or None when no worker can take the request now. spread: how
        many routers place on these workers from one view (this one included). A policy that
        picks the cheapest then picks one of the `spread` cheapest, by the request's id
        (pickers.one_of_cheapest): routers placing at the same instant, each unaware of the
        others' choices, spread them as one router placing them in turn would, instead of all
        giving the single cheapest worker their requests."""
        if not isinstance(self.picker, LowestCost):
            spread = 1
        candidates = self._ranked_candidates(workers, ticket, spread)
        if candidates is None:
            candidates = [w for w in workers if self._keeps(w, ticket)]
        if not candidates:
            return None
        costs = [0.0] * len(candidates)
        for weight, scorer in self.scorers:
            for i, cost in enumerate(scorer.costs(candidates, ticket)):
                costs[i] += weight * cost
        if spread > 1:
            return one_of_cheapest(candidates, costs, ticket, spread)
        return self.picker.pick(candidates, costs, ticket)

    def _keeps(self, worker: WorkerView, ticket: Ticket) -> bool:
        return all(f.keep(worker, ticket) for f in self.filters)

    def _ranked_candidates(
        self, workers: Sequence[WorkerView], ticket: Ticket, num_cheapest: int
    ) -> list[WorkerView] | None:
        """A few candidates the num_cheapest cheapest of all are among, or None to score them
        all: the cheapest by the workers' own costs within the prefill budget (if the other
        filters keep them), and the workers the prefix scorers credit, which alone can
        undercut them."""
        if not self._ranked or not isinstance(workers, RoleViews):
            return None
        if self._kv_use:
            cheapest = self._walked_cheapest(workers, ticket, num_cheapest)
        else:
            cheapest = self._cheapest_own(workers, ticket, num_cheapest)
        if not cheapest:
            return cheapest
        credited: set[str] = set()
        for scorer in self._prefix_scorers:
            ids = scorer.credited_ids(ticket)
            if ids is None:
                return None
            credited |= ids
        credited -= {w.worker_id for w in cheapest}
        views = (workers.get(worker_id) for worker_id in credited)
        return [*cheapest, *(v for v in views if v is not None and self._keeps(v, ticket))]

    def _cheapest_own(self, workers: RoleViews, ticket: Ticket, n: int) -> list[WorkerView] | None:
        """The n cheapest within the prefill budget by the workers' own costs, read in order
        from the ranking; None (score them all) when another filter refuses one of them."""
        ranking = workers.index(self, self._new_ranking)
        if n == 1:  # a lone router's every placement: the tree's minimum, no walk's heap
            found = ranking.cheapest(ticket)
            cheapest = [] if found is None else [found]
        else:
            keys, cheapest = ranking.in_order(ticket), []
            while len(cheapest) < n and (key := keys.next()) is not None:
                cheapest.append(ranking.view(key[-1]))
        if not all(self._keeps(w, ticket) for w in cheapest):
            return None
        return cheapest

    def _walked_cheapest(
        self, workers: RoleViews, ticket: Ticket, n: int
    ) -> list[WorkerView] | None:
        """The n cheapest candidates without prefix credit, for a policy that also weighs KV
        use (1 - (free - request's blocks) / KV size), among workers of one KV size. The
        workers within the prefill budget are read in order of the cost less KV use's
        request-dependent part, which is the same shift for all of them, so the walk stops once
        the next key plus the shift is over the n-th cost found; once one is the n-th, the rest
        with its own cost and free blocks (higher ids) are skipped. The walk reads no further
        than a scan of every candidate would, and usually a few workers: the workers over the
        budget are never read (they were read and refused one by one, more of them the larger
        the fleet). [] : no candidate; None: the workers' KV sizes differ, score them all."""
        if not workers.one_kv_size():
            return None
        if not self._may_fit(workers, ticket):
            return []
        num_blocks = max(1, workers.largest_total_blocks())
        shift = sum(w * (1.0 + ticket.num_kv_blocks / num_blocks) for w, _ in self._kv_use)
        ranking = workers.index(self, self._new_ranking)
        keys = ranking.in_order(ticket)
        best: list[tuple[float, str]] = []  # the n cheapest read so far, cheapest first
        next_key = keys.next()
        while next_key is not None:
            key, own, fewer_free, worker_id = next_key
            bound = key + shift
            if len(best) == n and bound - WALK_MARGIN * (1.0 + abs(bound)) > best[-1][0]:
                break
            view = ranking.view(worker_id)
            past: Key | None = None
            if self._keeps(view, ticket):
                cost = (self._uncredited_cost(view, ticket), worker_id)
                if len(best) < n or cost < best[-1]:
                    insort(best, cost)
                    del best[n:]
                    if len(best) == n and best[-1] == cost:
                        past = (key, own, fewer_free + 0.5)  # past its equals' keys
            next_key = keys.next(past)
        return [ranking.view(worker_id) for _, worker_id in best]

    def _may_fit(self, workers: RoleViews, ticket: Ticket) -> bool:
        """Some worker is within the prefill budget and has the request's KV room: the one
        with the most free blocks within the budget is read from a ranking of them by free
        blocks, so a full cluster's placement attempt does not read every worker to fail."""
        by_room = workers.index(self, lambda: Ranking(_most_free_first, self._budget), "by_room")
        roomiest = by_room.cheapest(ticket)
        if roomiest is None:
            return False
        return not self._needs_room or ticket.num_kv_blocks <= roomiest.free_blocks

    def _new_ranking(self) -> Ranking:
        return Ranking(self._walk_key if self._kv_use else self._own_key, self._budget)

    def _own_key(self, worker: WorkerView) -> Key:
        return (self._own_cost(worker), worker.worker_id)

    def _walk_key(self, worker: WorkerView) -> Key:
        """The cost less KV use's request-dependent part: own cost - w * free / KV size."""
        own = self._own_cost(worker)
        key = own
        for weight, _ in self._kv_use:
            key -= weight * worker.free_blocks / max(1, worker.total_blocks)
        return (key, own, -worker.free_blocks, worker.worker_id)

    def _uncredited_cost(self, worker: WorkerView, ticket: Ticket) -> float:
        """The worker's cost as choose() sums it, less any prefix credit (a prefix scorer's 0
        left out is the same float)."""
        cost = 0.0
        for weight, scorer in self._uncredited:
            cost += weight * scorer.costs([worker], ticket)[0]
        return cost

    def _own_cost(self, worker: WorkerView) -> float:
        """The worker's cost with no prefix credited: summed as choose() sums a candidate's
        costs, a prefix scorer's exact 0 left out, so it is the same float."""
        cost = 0.0
        for weight, scorer in self._own_scorers:
            cost += weight * scorer.cost(worker)
        return cost


def _most_free_first(worker: WorkerView) -> Key:
    return (-worker.free_blocks, worker.worker_id)
