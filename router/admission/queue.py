"""The admission queue: one FIFO per length bucket, served by virtual arrival time.

A request's virtual arrival is its arrival plus its bucket's delay (short 0, medium and long
more). The next request is the earliest virtual arrival among the bucket heads, so a short
request overtakes a long one that has waited less than the long delay, and once a long one
has waited that long, nothing arriving later overtakes it: its wait is bounded (aging).
With every delay 0 the order is plain arrival order: the FIFO baseline.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping

from pdserve.lengths import LENGTH_BUCKETS, LengthBucket
from router.ticket import Ticket


class AdmissionQueue:
    def __init__(self, delays_s: Mapping[LengthBucket, float]) -> None:
        self.delays_s = {bucket: delays_s[bucket] for bucket in LENGTH_BUCKETS}
        self._queues: dict[LengthBucket, deque[Ticket]] = {b: deque() for b in LENGTH_BUCKETS}
        self._sequence: dict[str, int] = {}  # push order: the last tie-break
        self._num_pushed = 0
        self.num_prompt_tokens = 0  # of every queued request, together
        self.num_changes = 0  # pushes, pops and removals
        # tokens_ahead's last answer: (the ticket, num_changes then, the tokens)
        self._last_ahead: tuple[Ticket, int, int] | None = None

    def __len__(self) -> int:
        return sum(len(q) for q in self._queues.values())

    def depth(self, bucket: LengthBucket) -> int:
        return len(self._queues[bucket])

    def push(self, ticket: Ticket) -> None:
        self._queues[ticket.bucket].append(ticket)
        self._sequence[ticket.request_id] = self._num_pushed
        self._num_pushed += 1
        self.num_prompt_tokens += ticket.num_prompt_tokens
        self.num_changes += 1

    def peek(self) -> Ticket | None:
        heads = [q[0] for q in self._queues.values() if q]
        return min(heads, key=self._order) if heads else None

    def pop(self) -> Ticket:
        ticket = self.peek()
        assert ticket is not None, "pop from an empty admission queue"
        del self._sequence[ticket.request_id]
        self.num_prompt_tokens -= ticket.num_prompt_tokens
        self.num_changes += 1
        return self._queues[ticket.bucket].popleft()

    def remove(self, ticket: Ticket) -> bool:
        try:
            self._queues[ticket.bucket].remove(ticket)
        except ValueError:
            return False
        del self._sequence[ticket.request_id]
        self.num_prompt_tokens -= ticket.num_prompt_tokens
        self.num_changes += 1
        return True

    def tokens_ahead(self, ticket: Ticket) -> int:
        """Prompt tokens of the queued requests served before this one. It scans the queue,
        which holds more requests the larger the fleet, and admission asks three times per
        arrival with the queue unchanged (for the wait, the TTFT and the TTFT's tokens): the
        last answer stands until the queue changes."""
        last = self._last_ahead
        if last is not None and last[0] is ticket and last[1] == self.num_changes:
            return last[2]
        order = self._order(ticket)
        tokens = sum(
            t.num_prompt_tokens
            for q in self._queues.values()
            for t in q
            if t is not ticket and self._order(t) < order
        )
        self._last_ahead = (ticket, self.num_changes, tokens)
        return tokens

    def virtual_arrival_s(self, ticket: Ticket) -> float:
        return ticket.arrival_s + self.delays_s[ticket.bucket]

    def _order(self, ticket: Ticket) -> tuple[float, float, int, int]:
        # Ties: earlier real arrival, then the shorter bucket, then push order.
        return (
            self.virtual_arrival_s(ticket),
            ticket.arrival_s,
            LENGTH_BUCKETS.index(ticket.bucket),
            self._sequence.get(ticket.request_id, self._num_pushed),  # not queued: last
        )
