"""Admission control: queue a request until a prefill worker has token budget and a decode
worker has KV room for it (or one aggregated worker has both), or reject it at once when the
queue is full or, with a TTFT objective set, when its predicted time to first token (corrected
by what earlier requests saw) is over the objective.

Which pool serves a request: with only aggregated workers, or only prefill + decode pools,
that one. A mixed cluster sends short-bucket prompts whole to the aggregated workers (a short
prefill hardly stalls their decode batch) and medium and long ones split across the P/D pools
(where a long prefill delays no one's decode). With prefill_overflow "decode", a split request
that finds every prefill worker at its budget goes whole to a decode worker with room instead
of waiting: that worker computes the prompt beside its decode batch."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from typing import Literal

from pdserve.lengths import LENGTH_BUCKETS
from pdserve.registry import Role
from router import metrics
from router.admission import metrics as admission_metrics
from router.admission.drain import DrainRates
from router.admission.queue import AdmissionQueue
from router.admission.ttft_error import TTFTCorrections
from router.errors import InvalidRequestError, OverloadedError, RejectReason, UnavailableError
from router.ledger import Assignment
from router.prefix_index import PrefixIndex
from router.routing import RoutingPolicies
from router.routing.framework import Policy
from router.settings import AdmissionSettings
from router.ticket import Ticket
from router.workers import RoleViews, WorkerPool, WorkerView

Kind = Literal["aggregated", "split"]  # served whole by one worker, or by a prefill + a decode


@dataclass(frozen=True, slots=True)
class Prediction:
    """What admission predicted when the request arrived (at_s, on the admission clock)."""

    kind: Kind
    at_s: float
    wait_s: float  # the router queue wait
    ttft_s: float  # the time to first token, as admission shed by it
    ttft_tokens: int  # the prompt tokens that time was modelled from (_ttft_tokens)


@dataclass(slots=True)
class Lease:
    """A dispatched request's hold on its workers: the prefill hold ends with the first token,
    the decode hold with the request. On an aggregated worker prefill and decode are one."""

    ticket: Ticket
    prefill: WorkerView
    decode: WorkerView
    queue_wait_s: float
    holds: dict[Role, Assignment]
    release: Callable[[Role, Assignment], None]
    prediction: Prediction
    first_token: Callable[[Lease], None]

    def end_prefill(self) -> None:
        """At the request's first token (a failed request's holds end through end())."""
        hold = self.holds["prefill"]
        is_first = hold.ended_at is None
        self.release("prefill", hold)
        if is_first:
            self.first_token(self)

    def end(self) -> None:
        for role, hold in self.holds.items():
            self.release(role, hold)


class Admission:
    def __init__(
        self, settings: AdmissionSettings, pool: WorkerPool, policies: RoutingPolicies,
        clock: Callable[[], float] = time.monotonic, prefixes: PrefixIndex | None = None,
    ) -> None:  # fmt: skip
        self.settings = settings
        self.pool = pool
        self.policies = policies
        self.clock = clock
        self.prefixes = prefixes  # records each choice's prefix overlap
        self.queue = AdmissionQueue(settings.delays_s())
        self._waiters: dict[str, asyncio.Future[Lease]] = {}
        self._predictions: dict[str, Prediction] = {}  # queued requests' predictions at arrival
        self.drain = DrainRates()  # how fast each worker's prefill budget really frees
        # observed / modelled TTFT per pool kind, learned from the predictions near the objective
        slo_s = settings.ttft_slo_s
        self.ttft_corrections = TTFTCorrections(1.0 if slo_s is None else 0.5 * slo_s)
        # the gauges set after every dispatch, looked up once (labels() is not cheap)
        self._depth_gauges = {b: metrics.QUEUE_DEPTH.labels(b) for b in LENGTH_BUCKETS}
        self._observed_changes = -1  # the queue's num_changes when its gauges were last set
        # Awaited once a request is placed, before admit() returns its lease: router replicas
        # hold a long prompt until the peers know of it (ReplicaSync.hold).
        self.before_send: Callable[[Ticket], Awaitable[None]] | None = None

    async def admit(self, ticket: Ticket) -> Lease:
        """Waits for the request's turn; raises OverloadedError or UnavailableError instead of
        queueing when it cannot be served in time."""
        self._check_pools(ticket)
        future: asyncio.Future[Lease] = asyncio.get_running_loop().create_future()
        self._waiters[ticket.request_id] = future
        wait_s = self.estimated_wait_s(ticket)
        self._predictions[ticket.request_id] = Prediction(
            self.kind(ticket), self.clock(), wait_s, self.predicted_ttft_s(ticket),
            self._ttft_tokens(ticket),
        )  # fmt: skip
        self.queue.push(ticket)
        self.dispatch()
        if not future.done():
            self._check_queue(ticket, wait_s)
        try:
            async with asyncio.timeout(self.settings.queue_timeout_s):
                lease = await future
        except TimeoutError:
            retry_s = self.predicted_ttft_s(ticket)
            self._abandon(ticket, future)
            raise self._reject(
                ticket, "queue_timeout",
                f"waited {self.settings.queue_timeout_s:.0f} s in the queue without capacity",
                max(1.0, retry_s),
            ) from None  # fmt: skip
        except asyncio.CancelledError:  # the client went away while queued
            self._abandon(ticket, future)
            raise
        if self.before_send is not None:
            try:
                await self.before_send(ticket)
            except BaseException:  # the client went away while it was held: its holds end
                lease.end()
                raise
        return lease

    def dispatch(self) -> None:
        """Hands out leases in queue order while the head request fits; strict head-of-line,
        so a request that does not fit yet is never starved by smaller ones behind it."""
        while (ticket := self.queue.peek()) is not None:
            future = self._waiters.get(ticket.request_id)
            if future is None or future.done():  # cancelled while queued
                self.queue.pop()
                self._waiters.pop(ticket.request_id, None)
                self._predictions.pop(ticket.request_id, None)
                continue
            lease = self._place(ticket)
            if lease is None:
                break
            self.queue.pop()
            del self._waiters[ticket.request_id]
            future.set_result(lease)
        self._observe_depth()

    def kind(self, ticket: Ticket) -> Kind:
        """The pool that serves the request (the module docstring's rule)."""
        aggregated = self.policies.aggregated is not None and self.pool.has("aggregated")
        split = self.pool.has("prefill") and self.pool.has("decode")
        if aggregated and split:
            return "aggregated" if ticket.bucket == "short" else "split"
        return "aggregated" if aggregated else "split"

    def _prefill_side(self, ticket: Ticket) -> RoleViews:
        return self.pool.role_views(
            "aggregated" if self.kind(ticket) == "aggregated" else "prefill"
        )

    def estimated_wait_s(self, ticket: Ticket) -> float:
        """The router queue wait: when the tokens in front of this request (in the workers
        that would prefill it and ahead in the queue) have drained to within the workers'
        budgets, it can go: that many tokens at the workers' measured speed."""
        workers = self._prefill_side(ticket)
        if not workers:
            return 0.0
        in_front = workers.queued_tokens + self.queue.tokens_ahead(ticket)
        budget = self.settings.prefill_token_budget * len(workers)
        excess = in_front + ticket.num_prompt_tokens - budget
        return max(0.0, excess) / self.drain.pool_speed(workers)

    def predicted_ttft_s(self, ticket: Ticket) -> float:
        """Arrival to first token as admission sheds by it: the modelled time, times what
        requests of this pool have seen against their own modelled times."""
        return self._modelled_ttft_s(ticket) * self.ttft_corrections.factor(self.kind(ticket))

    def _modelled_ttft_s(self, ticket: Ticket) -> float:
        return self._ttft_tokens(ticket) / self._pool_speed(ticket)

    def _ttft_tokens(self, ticket: Ticket) -> int:
        """Every prompt token in front of it (in those workers and ahead in the queue), then
        its own prompt on one worker (so counted once per worker of the pool's speed)."""
        workers = self._prefill_side(ticket)
        in_front = workers.queued_tokens + self.queue.tokens_ahead(ticket)
        return in_front + ticket.num_prompt_tokens * len(workers)

    def _pool_speed(self, ticket: Ticket) -> float:
        workers = self._prefill_side(ticket)
        return self.drain.pool_speed(workers) if workers else float("inf")

    def _choose(self, ticket: Ticket) -> tuple[WorkerView, WorkerView, Ticket] | None:
        """(prefill, decode) workers with room now, one worker twice when aggregated, and the
        ticket as the prefill worker was chosen by. With a prefix index the decode worker comes
        first: a prefill worker that fetches can read the prefix it holds
        (Ticket.held_prefix_tokens). Without one, the prefill worker does."""
        if self.kind(ticket) == "aggregated":
            assert self.policies.aggregated is not None
            worker = self._choose_on(self.policies.aggregated, "aggregated", ticket)
            return None if worker is None else (worker, worker, ticket)
        if self.prefixes is None:
            prefill = self._choose_on(self.policies.prefill, "prefill", ticket)
            if prefill is None:
                return self._overflow(ticket)
            decode = self._choose_decode(ticket)
            return None if decode is None else (prefill, decode, ticket)
        decode = self._choose_decode(ticket)
        if decode is None:
            return None
        scored = ticket
        if decode.info.peer_fetch:
            held = self.prefixes.overlap_tokens(decode.info, ticket)
            scored = replace(ticket, held_prefix_tokens=held)
        prefill = self._choose_on(self.policies.prefill, "prefill", scored)
        return self._overflow(ticket) if prefill is None else (prefill, decode, scored)

    def _overflow(self, ticket: Ticket) -> tuple[WorkerView, WorkerView, Ticket] | None:
        """Every prefill worker is at its budget: with prefill_overflow "decode", the request
        goes whole to a decode worker, chosen as an aggregated worker is (its prompt held on
        that worker's prefill side, within the same budget), which computes the prompt."""
        if self.settings.prefill_overflow != "decode" or self.policies.aggregated is None:
            return None
        worker = self._choose_on(self.policies.aggregated, "decode", ticket)
        return None if worker is None else (worker, worker, ticket)

    def _choose_decode(self, ticket: Ticket) -> WorkerView | None:
        return self._choose_on(self.policies.decode, "decode", ticket)

    def _choose_on(self, policy: Policy, role: Role, ticket: Ticket) -> WorkerView | None:
        """The policy's choice among the role's workers, spread over as many of the cheapest
        as there are routers placing on them (Policy.choose)."""
        return policy.choose(self.pool.role_views(role), ticket, self.pool.num_routers)

    def _place(self, ticket: Ticket) -> Lease | None:
        chosen = self._choose(ticket)
        if chosen is None:
            return None
        prefill, decode, scored = chosen
        num_to_prefill = ticket.num_prompt_tokens
        if self.prefixes is not None:  # the prefill worker computes only what it lacks
            self.prefixes.record(ticket, prefill.info, decode.info)
            num_to_prefill -= sum(self.prefixes.prefill_prefix(prefill.info, scored))
        holds = self.pool.assign_request(
            ("prefill", prefill.worker_id, num_to_prefill, 1),
            ("decode", decode.worker_id, ticket.num_kv_blocks, ticket.num_seqs),
        )
        now_s = self.clock()
        self.drain.started(prefill.worker_id, now_s)
        wait_s = now_s - ticket.arrival_s
        metrics.child(metrics.QUEUE_WAIT, ticket.bucket).observe(wait_s)
        prediction = self._predictions.pop(ticket.request_id)
        metrics.child(admission_metrics.QUEUE_WAIT_PREDICTED, ticket.bucket).observe(
            prediction.wait_s
        )
        metrics.child(admission_metrics.QUEUE_WAIT_ERROR, ticket.bucket).observe(
            wait_s - prediction.wait_s
        )
        if prefill is decode:  # "decode_prefill": a decode worker given a prompt (_overflow)
            whole = "aggregated" if prefill.info.role == "aggregated" else "decode_prefill"
            metrics.child(metrics.ROUTED, whole, prefill.worker_id).inc()
        else:
            metrics.child(metrics.ROUTED, "prefill", prefill.worker_id).inc()
            metrics.child(metrics.ROUTED, "decode", decode.worker_id).inc()
        return Lease(
            ticket, prefill, decode, wait_s, holds, self._release, prediction, self._first_token
        )

    def _first_token(self, lease: Lease) -> None:
        """Learns how far the model's TTFT is from the one this request saw. The model is
        evaluated at today's speeds (the drain meters have just seen this request end its
        hold), so the factor learns only what they do not already correct."""
        prediction, kind = lease.prediction, lease.prediction.kind
        metrics.child(admission_metrics.TTFT_PREDICTED, lease.ticket.bucket).observe(
            prediction.ttft_s
        )
        modelled_s = prediction.ttft_tokens / self._pool_speed(lease.ticket)
        self.ttft_corrections.observe(kind, modelled_s, self.clock() - prediction.at_s)
        metrics.child(admission_metrics.TTFT_CORRECTION, kind).set(
            self.ttft_corrections.factor(kind)
        )
        margin = self.ttft_corrections.tail_margin(kind)
        metrics.child(admission_metrics.TTFT_TAIL_MARGIN, kind).set(margin)

    def _release(self, role: Role, hold: Assignment) -> None:
        if hold.ended_at is None:
            self.pool.release(role, hold)
            if role == "prefill":
                self.drain.ended(hold.worker_id, hold.amount, self.clock())
            self.dispatch()

    def _check_pools(self, ticket: Ticket) -> None:
        if not self.pool.serving():
            for role in ("prefill", "decode"):
                if not self.pool.has(role):
                    raise UnavailableError(
                        f"no {role} worker (and no aggregated worker) is registered; retry "
                        "when one is up"
                    )
        decode = self.pool.role_views(
            "aggregated" if self.kind(ticket) == "aggregated" else "decode"
        )
        self._check_capacity(ticket, decode)
        num_free, num_total = decode.free_blocks, decode.total_blocks
        headroom_checked = self.settings.mode != "pass_through"
        if headroom_checked and num_free < self.settings.kv_reject_below_ratio * num_total:
            raise self._reject(
                ticket, "kv_headroom",
                f"decode KV cache is full ({num_free} of {num_total} blocks free)", 1.0,
            )  # fmt: skip

    def _check_capacity(self, ticket: Ticket, decode: RoleViews) -> None:
        """A KV hold larger than the largest decode worker's whole cache fits nowhere, however
        long it waits: refused at once. Only while every one reports its capacity (a worker
        with 0 total blocks has not yet); a busy or empty pool is the checks' above and below."""
        if not decode or not decode.all_report_capacity():
            return
        largest = decode.largest_total_blocks()
        if ticket.num_kv_blocks <= largest:
            return
        samples = f" for each of its {ticket.num_seqs} samples" if ticket.num_seqs > 1 else ""
        raise InvalidRequestError(
            f"this request needs {ticket.num_kv_blocks} KV blocks of "
            f"{ticket.block_size} tokens (its {ticket.num_prompt_tokens}-token prompt "
            f"and an output reserve{samples}), the largest decode worker has {largest}",
            code="kv_capacity_exceeded",
        )

    def _check_queue(self, ticket: Ticket, wait_s: float) -> None:
        """For a request that has to wait: is there room, and would it get its first token in
        time? Retry-After: when enough of what is in front has drained."""
        settings = self.settings
        if len(self.queue) > settings.max_queued_requests:
            self._drop(ticket, "queue_full", f"{len(self.queue) - 1} requests queued", wait_s)
        slo_s = settings.ttft_slo_s
        if slo_s is not None:
            ttft_s = self.predicted_ttft_s(ticket)
            # What the requests' tail saw beyond the prediction (ttft_error.py): shed by it.
            tail_s = ttft_s * self.ttft_corrections.tail_margin(self.kind(ticket))
            if tail_s > slo_s:
                bound = f" ({tail_s:.1f} s at the 99th percentile)" if tail_s > ttft_s else ""
                message = (
                    f"predicted time to first token {ttft_s:.1f} s{bound} is over the "
                    f"{slo_s:.1f} s SLO"
                )
                self._drop(ticket, "queue_wait", message, tail_s - slo_s)
        limit_s = settings.max_queue_wait_s
        if limit_s is not None and wait_s > limit_s:
            message = f"estimated queue wait {wait_s:.1f} s is over the {limit_s:.1f} s limit"
            self._drop(ticket, "queue_wait", message, wait_s - limit_s)

    def _drop(self, ticket: Ticket, reason: RejectReason, message: str, retry_s: float) -> None:
        self.queue.remove(ticket)
        del self._waiters[ticket.request_id]
        self._predictions.pop(ticket.request_id, None)
        self._observe_depth()
        raise self._reject(ticket, reason, message, max(1.0, retry_s))

    def _abandon(self, ticket: Ticket, future: asyncio.Future[Lease]) -> None:
        self._waiters.pop(ticket.request_id, None)
        self._predictions.pop(ticket.request_id, None)
        if self.queue.remove(ticket):
            self._observe_depth()
        elif future.done() and not future.cancelled():
            future.result().end()  # dispatched just as the client gave up: hand it back

    def _reject(
        self, ticket: Ticket, reason: RejectReason, message: str, retry_after_s: float
    ) -> OverloadedError:
        metrics.child(metrics.REJECTIONS, reason, ticket.bucket).inc()
        return OverloadedError(reason, message, retry_after_s)

    def _observe_depth(self) -> None:
        """Sets the queue's gauges, unless they already show it: a dispatch that places
        nothing (most, under load) leaves the queue as it was."""
        if self.queue.num_changes == self._observed_changes:
            return
        self._observed_changes = self.queue.num_changes
        for bucket, gauge in self._depth_gauges.items():
            gauge.set(self.queue.depth(bucket))
        metrics.QUEUED_PROMPT_TOKENS.set(self.queue.num_prompt_tokens)
