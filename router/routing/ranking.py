"""Candidates kept in cost order, for a policy that picks the cheapest worker by costs that
each worker's own view decides: its choice is found in O(log budget) whatever the number of
workers, not by scoring every one. A policy that walks the workers near the cheapest
(Policy._walked_cheapest) reads the keys within the budget in order, the others never seen.

Under a prefill token budget the cheapest worker within it is what matters, so workers are
kept by their queued tokens (0..budget; one over it, or fenced, never passes) in a min segment
tree whose leaves are the (cost, worker id) keys of the workers at that count, sorted: the
cheapest with at most q queued tokens is a prefix query, and a view change is one leaf and its
path up. The tree covers the counts workers have held so far (doubling when one holds more),
not the whole budget, which may be far larger."""

from __future__ import annotations

from bisect import bisect_left, bisect_right, insort
from collections.abc import Callable
from heapq import heapify, heappop, heappush, heapreplace
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
        left: int | None = None  # the leaf the old key left, its path not updated yet
        if old is not None:
            self._views.pop(old.worker_id)
            placed = self._placed.pop(old.worker_id, None)
            if placed is not None:
                left, key = placed
                keys = self._leaves[left]
                del keys[bisect_left(keys, key)]
        if new is not None:
            self._views[new.worker_id] = new
            leaf = new.queued_tokens if self._budget is not None else 0
            if leaf <= self._max_queued and not (new.fenced and self._budget is not None):
                if leaf >= self._num_leaves:
                    self._grow(leaf)  # every leaf's path, the one left included
                    left = None
                key = self._key(new)
                insort(self._leaves.setdefault(leaf, []), key)
                self._placed[new.worker_id] = (leaf, key)
                self._update(leaf)
                if left == leaf:  # one path to update (a change of its KV alone)
                    left = None
        if left is not None:
            self._update(left)

    def cheapest(self, ticket: Ticket) -> WorkerView | None:
        """The cheapest worker within the budget (the other filters unchecked)."""
        best: Key | None = None
        for node in self._within(ticket):
            best = _least(best, self._min[node])
        return None if best is None else self._views[best[-1]]

    def in_order(self, ticket: Ticket) -> InOrder:
        """The keys of the workers within the budget, cheapest first (the other filters
        unchecked)."""
        return InOrder(self, self._within(ticket))

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
            least = _least(self._min[2 * i], self._min[2 * i + 1])
            if least == self._min[i]:  # and so are its ancestors'
                break
            self._min[i] = least

    def _within(self, ticket: Ticket) -> list[int]:
        """The tree's nodes that together cover the leaves within the budget for the ticket."""
        last = 0 if self._budget is None else self._budget.max_queued_tokens(ticket)
        nodes: list[int] = []
        lo, hi = self._num_leaves, min(last, self._num_leaves - 1) + self._num_leaves + 1
        while lo < hi:
            if lo & 1:
                nodes.append(lo)
                lo += 1
            if hi & 1:
                hi -= 1
                nodes.append(hi)
            lo //= 2
            hi //= 2
        return nodes


class InOrder:
    """A ranking's keys within a budget, read cheapest first: its leaves merged lazily, led by
    the tree's minima (a subtree is opened only when its cheapest is next), so a key read
    costs O(log) however many workers are over the budget, not one step past each of them.
    The ranking must not change while it is read."""

    def __init__(self, ranking: Ranking, nodes: list[int]) -> None:
        self._min, self._leaves = ranking._min, ranking._leaves
        self._num_leaves = ranking._num_leaves
        # (the cheapest key under the node, the node, the next key's index in a leaf's list)
        self._heap = [(self._min[n], n, 0) for n in nodes if self._min[n] is not None]
        heapify(self._heap)

    def next(self, past: Key | None = None) -> Key | None:
        """The cheapest key not read yet (None: none is left); past: the cheapest above it,
        every key up to it skipped."""
        heap = self._heap
        while heap:
            key, node, i = heap[0]
            if node < self._num_leaves:  # a subtree: its halves take its place
                heappop(heap)
                for half in (2 * node, 2 * node + 1):
                    if (least := self._min[half]) is not None:
                        heappush(heap, (least, half, 0))
                continue
            keys = self._leaves[node - self._num_leaves]
            skipped = past is not None and key <= past
            i = bisect_right(keys, past, i) if skipped else i + 1
            if i < len(keys):
                heapreplace(heap, (keys[i], node, i))
            else:
                heappop(heap)
            if not skipped:
                return key
        return None


def _least(a: Key | None, b: Key | None) -> Key | None:
    if a is None:
        return b
    if b is None:
        return a
    return min(a, b)
