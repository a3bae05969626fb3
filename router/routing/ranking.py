"""Candidates kept in cost order, for a policy that picks the cheapest worker by costs that
each worker's own view decides: its choice is found in O(log budget) whatever the number of
workers, not by scoring every one. A ranking without a budget keeps every key in one sorted
list, for a policy to walk (Policy._walked_cheapest).

Under a prefill token budget the cheapest worker within it is what matters, so workers are
kept by their queued tokens (0..budget; one over it, or fenced, never passes) in a min segment
tree whose leaves are the (cost, worker id) keys of the workers at that count, sorted: the
cheapest with at most q queued tokens is a prefix query, and a view change is one leaf and its
path up. The tree covers the counts workers have held so far (doubling when one holds more),
not the whole budget, which may be far larger."""

from __future__ import annotations

from bisect import bisect_left, insort
from collections.abc import Callable
from typing import Any

from router.routing.filters import PrefillBudget
from router.ticket import Ticket
from router.workers import WorkerView

# What orders the workers, first first, ending with the worker id (ties to the lower id, as
# LowestCost's): the policy builds it (Policy._own_key, _walk_key, _most_free_first).
Key = tuple[Any, ...]


class Ranking:
    def __init__(self, key: Callable[[WorkerView], Key], budget: PrefillBudget | None) -> None:
        self._key = key
        self._budget = budget
        self._max_queued = budget.budget_tokens if budget is not None else 0
        self._num_leaves = 1
        self._min: list[Key | None] = [None, None]  # [1]: the root; leaf q at num_leaves + q
        self._leaves: dict[int, list[Key]] = {}
        self._placed: dict[str, tuple[int, Key]] = {}  # worker id -> (its leaf, its key)
        self._views: dict[str, WorkerView] = {}

    def changed(self, old: WorkerView | None, new: WorkerView | None) -> None:
        if old is not None:
            self._views.pop(old.worker_id)
            placed = self._placed.pop(old.worker_id, None)
            if placed is not None:
                leaf, key = placed
                keys = self._leaves[leaf]
                del keys[bisect_left(keys, key)]
                self._update(leaf)
        if new is not None:
            self._views[new.worker_id] = new
            leaf = new.queued_tokens if self._budget is not None else 0
            if leaf <= self._max_queued and not (new.fenced and self._budget is not None):
                if leaf >= self._num_leaves:
                    self._grow(leaf)
                key = self._key(new)
                insort(self._leaves.setdefault(leaf, []), key)
                self._placed[new.worker_id] = (leaf, key)
                self._update(leaf)

    def cheapest(self, ticket: Ticket) -> WorkerView | None:
        """The cheapest worker within the budget (the other filters unchecked)."""
        last = 0 if self._budget is None else self._budget.max_queued_tokens(ticket)
        best = self._cheapest_up_to(min(last, self._num_leaves - 1))
        return None if best is None else self._views[best[-1]]

    def ordered(self) -> list[Key]:
        """Every worker's key, in order (without a budget, the one leaf holds them all)."""
        assert self._budget is None
        return self._leaves.get(0, [])

    def view(self, worker_id: str) -> WorkerView:
        return self._views[worker_id]

    def _grow(self, leaf: int) -> None:
        self._num_leaves = 1 << leaf.bit_length()
        self._min = [None] * (2 * self._num_leaves)
        for other in self._leaves:
            self._update(other)

    def _update(self, leaf: int) -> None:
        keys = self._leaves[leaf]
        i = leaf + self._num_leaves
        self._min[i] = keys[0] if keys else None
        while i > 1:
            i //= 2
            self._min[i] = _least(self._min[2 * i], self._min[2 * i + 1])

    def _cheapest_up_to(self, last: int) -> Key | None:
        best: Key | None = None
        lo, hi = self._num_leaves, last + self._num_leaves + 1  # leaves [0, last]
        while lo < hi:
            if lo & 1:
                best = _least(best, self._min[lo])
                lo += 1
            if hi & 1:
                hi -= 1
                best = _least(best, self._min[hi])
            lo //= 2
            hi //= 2
        return best


def _least(a: Key | None, b: Key | None) -> Key | None:
    if a is None:
        return b
    if b is None:
        return a
    return min(a, b)
