"""The admission queue: one queue per length bucket, served by virtual arrival time.

A request's virtual arrival is its arrival plus its bucket's delay (short 0, medium and long
more). The next request is the earliest virtual arrival among the bucket heads, so a short
request overtakes a long one that has waited less than the long delay, and once a long one
has waited that long, nothing arriving later overtakes it: its wait is bounded (aging).
With every delay 0 the order is plain arrival order: the FIFO baseline.

Each bucket is kept in that order, with its prompt tokens summed along it, so the tokens served
before a request are a binary search per bucket: admission asks on every arrival, and the queue
holds more requests the larger the fleet. Requests arrive in order, so a push appends; one
pushed again (a retry keeps its arrival) goes back to its place by arrival, not behind later
arrivals.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Mapping

from pdserve.lengths import LENGTH_BUCKETS, LengthBucket
from router.ticket import Ticket

# (virtual arrival, arrival, bucket index, push order): ties go to the earlier real arrival,
# then the shorter bucket, then push order.
Order = tuple[float, float, int, int]


class _Bucket:
    """One bucket's requests in service order, with cumulative prompt tokens: the tickets at
    [i, j) hold cum[j] - cum[i] tokens (cum has one entry more than the tickets)."""

    def __init__(self) -> None:
        self.orders: list[Order] = []
        self.tickets: list[Ticket] = []
        self.cum: list[int] = [0]

    def insert(self, order: Order, ticket: Ticket) -> None:
        i = len(self.orders)
        if i and order < self.orders[-1]:
            i = bisect_left(self.orders, order)
        self.orders.insert(i, order)
        self.tickets.insert(i, ticket)
        self.cum.insert(i + 1, self.cum[i])
        self._shift(i + 1, ticket.num_prompt_tokens)

    def delete(self, i: int) -> Ticket:
        del self.orders[i]
        ticket = self.tickets.pop(i)
        if i == 0:  # the head: the sums after it stand, from a new base
            del self.cum[0]
        else:
            del self.cum[i + 1]
            self._shift(i + 1, -ticket.num_prompt_tokens)
        return ticket

    def tokens_before(self, order: Order) -> int:
        return self.cum[bisect_left(self.orders, order)] - self.cum[0]

    def _shift(self, start: int, num_tokens: int) -> None:
        cum = self.cum
        for k in range(start, len(cum)):
            cum[k] += num_tokens


class AdmissionQueue:
    def __init__(self, delays_s: Mapping[LengthBucket, float]) -> None:
        self.delays_s = {bucket: delays_s[bucket] for bucket in LENGTH_BUCKETS}
        self._buckets: dict[LengthBucket, _Bucket] = {b: _Bucket() for b in LENGTH_BUCKETS}
        self._orders: dict[str, Order] = {}  # of the queued requests, by request id
        self._num_pushed = 0
        self.num_prompt_tokens = 0  # of every queued request, together
        self.num_changes = 0  # pushes, pops and removals

    def __len__(self) -> int:
        return len(self._orders)

    def depth(self, bucket: LengthBucket) -> int:
        return len(self._buckets[bucket].tickets)

    def push(self, ticket: Ticket) -> None:
        order = self._order(ticket, self._num_pushed)
        self._buckets[ticket.bucket].insert(order, ticket)
        self._orders[ticket.request_id] = order
        self._num_pushed += 1
        self.num_prompt_tokens += ticket.num_prompt_tokens
        self.num_changes += 1

    def peek(self) -> Ticket | None:
        head = self._head()
        return None if head is None else head.tickets[0]

    def pop(self) -> Ticket:
        head = self._head()
        assert head is not None, "pop from an empty admission queue"
        return self._taken(head.delete(0))

    def remove(self, ticket: Ticket) -> bool:
        order = self._orders.get(ticket.request_id)
        bucket = self._buckets[ticket.bucket]
        i = -1 if order is None else bisect_left(bucket.orders, order)
        if i < 0 or i == len(bucket.tickets) or bucket.tickets[i] is not ticket:
            return False
        self._taken(bucket.delete(i))
        return True

    def tokens_ahead(self, ticket: Ticket) -> int:
        """Prompt tokens of the queued requests served before this one (queued or not)."""
        order = self._orders.get(ticket.request_id) or self._order(ticket, self._num_pushed)
        return sum(bucket.tokens_before(order) for bucket in self._buckets.values())

    def _head(self) -> _Bucket | None:
        heads = [b for b in self._buckets.values() if b.orders]
        return min(heads, key=lambda b: b.orders[0]) if heads else None

    def _taken(self, ticket: Ticket) -> Ticket:
        del self._orders[ticket.request_id]
        self.num_prompt_tokens -= ticket.num_prompt_tokens
        self.num_changes += 1
        return ticket

    def _order(self, ticket: Ticket, sequence: int) -> Order:
        virtual_arrival_s = ticket.arrival_s + self.delays_s[ticket.bucket]
        return (virtual_arrival_s, ticket.arrival_s, LENGTH_BUCKETS.index(ticket.bucket),
                sequence)  # fmt: skip
