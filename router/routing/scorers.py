"""Scorers: the cost of placing a request on each candidate worker (lower is better)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from router.prefix_index import FETCHED_TOKEN_WORTH, PrefixIndex
from router.ticket import Ticket
from router.workers import WorkerView


@dataclass(frozen=True, slots=True)
class Watermark:
    """T = a * queued_tokens / tokens_per_s + b * queued_requests: seconds of prefill already
    queued on the worker at its own measured speed, plus a per-request overhead term, so a
    worker half as fast gets half the tokens."""

    a: float = 0.6
    b: float = 0.4

    def costs(self, workers: Sequence[WorkerView], ticket: Ticket) -> list[float]:
        return [self.cost(w) for w in workers]

    def cost(self, worker: WorkerView) -> float:
        return self.a * worker.queued_tokens / worker.tokens_per_s + self.b * worker.queued_requests


@dataclass(frozen=True, slots=True)
class KVUsage:
    """Fraction of the decode worker's KV in use once this request holds its blocks."""

    def costs(self, workers: Sequence[WorkerView], ticket: Ticket) -> list[float]:
        return [
            1.0 - (w.free_blocks - ticket.num_kv_blocks) / max(1, w.total_blocks) for w in workers
        ]


@dataclass(frozen=True, slots=True)
class RunningRequests:
    """Running requests relative to the busiest candidate: spreads the decode batch."""

    def costs(self, workers: Sequence[WorkerView], ticket: Ticket) -> list[float]:
        busiest = max(w.running_requests for w in workers)
        return [w.running_requests / busiest if busiest else 0.0 for w in workers]


@dataclass(frozen=True, slots=True)
class PrefillSaved:
    """Seconds of prefill the worker's prefix cache saves this request (its cached prompt
    tokens at its measured speed), as a negative cost in the watermark's unit. A worker that
    fetches is credited the chosen decode worker's longer prefix too, a fetched token worth
    FETCHED_TOKEN_WORTH of a cached one."""

    prefixes: PrefixIndex

    def costs(self, workers: Sequence[WorkerView], ticket: Ticket) -> list[float]:
        return [-self._saved_tokens(w, ticket) / w.tokens_per_s for w in workers]

    def credited_ids(self, ticket: Ticket) -> set[str] | None:
        # Read from the chosen decode worker, a prefix is credited to every worker that fetches.
        return None if ticket.held_prefix_tokens else self.prefixes.holders(ticket)

    def _saved_tokens(self, worker: WorkerView, ticket: Ticket) -> float:
        own, fetched = self.prefixes.prefill_prefix(worker.info, ticket)
        return own + FETCHED_TOKEN_WORTH * fetched


@dataclass(frozen=True, slots=True)
class KVSaved:
    """The fraction of the prompt's KV the decode worker already holds (neither sent nor
    allocated again), as a negative cost."""

    prefixes: PrefixIndex

    def costs(self, workers: Sequence[WorkerView], ticket: Ticket) -> list[float]:
        num_prompt = max(1, ticket.num_prompt_tokens)
        return [-self.prefixes.overlap_tokens(w.info, ticket) / num_prompt for w in workers]

    def credited_ids(self, ticket: Ticket) -> set[str] | None:
        return self.prefixes.holders(ticket)
