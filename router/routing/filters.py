"""Filters: which workers can take a request at all, and which have room for it now."""

from __future__ import annotations

from dataclasses import dataclass

from router.ticket import Ticket
from router.workers import WorkerView


@dataclass(frozen=True, slots=True)
class ContextFits:
    """The worker's context holds the prompt and every token asked for."""

    def keep(self, worker: WorkerView, ticket: Ticket) -> bool:
        return ticket.num_total_tokens <= worker.info.max_model_len


@dataclass(frozen=True, slots=True)
class PrefillBudget:
    """At most budget_tokens prompt tokens in a prefill worker at once; an idle worker always
    takes one request, or a prompt over the budget could never run. A fenced worker takes
    none: with router replicas, each may have given it one request the others have not heard
    of, and no more, so it holds at most its budget plus one request per router."""

    budget_tokens: int

    def keep(self, worker: WorkerView, ticket: Ticket) -> bool:
        return not worker.fenced and worker.queued_tokens <= self.max_queued_tokens(ticket)

    def max_queued_tokens(self, ticket: Ticket) -> int:
        """The most a worker may hold and still take this request (queued tokens are >= 0)."""
        return max(0, self.budget_tokens - ticket.num_prompt_tokens)


@dataclass(frozen=True, slots=True)
class NotExcluded:
    """Not a worker the request was already lost on (a migrated request moves elsewhere)."""

    def keep(self, worker: WorkerView, ticket: Ticket) -> bool:
        return worker.worker_id not in ticket.excluded_decode_ids


@dataclass(frozen=True, slots=True)
class KVFits:
    """The decode worker has free blocks for the request's prompt and output reserve."""

    def keep(self, worker: WorkerView, ticket: Ticket) -> bool:
        return ticket.num_kv_blocks <= worker.free_blocks


@dataclass(frozen=True, slots=True)
class RequestSlots:
    """The decode-side worker takes the request's sequences within its limit (past it, it
    would refuse with RESOURCE_EXHAUSTED), counting the routers' own since its heartbeat; an
    idle one takes any, as the engine does. A worker that states no limit always does."""

    def keep(self, worker: WorkerView, ticket: Ticket) -> bool:
        limit, running = worker.info.max_requests, worker.running_requests
        return limit <= 0 or running == 0 or running + ticket.num_seqs <= limit
