"""The scheduler: continuous batching with chunked prefill under a per-step token budget,
admission by KV watermark, and preemption (free, recompute later) when blocks run out."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from engine.config import EngineConfig, step_overhead_tokens_for
from engine.kv_cache_manager import KVCacheManager
from engine.request import Request


@dataclass(frozen=True, slots=True)
class ScheduledRequest:
    """One request's share of a step: its next num_new_tokens tokens go through the model."""

    request: Request
    num_new_tokens: int

    @property
    def completes_pass(self) -> bool:
        """After this step the request has KV for all its tokens and needs a next token."""
        return self.request.num_computed_tokens + self.num_new_tokens == self.request.num_tokens


class Scheduler:
    def __init__(self, config: EngineConfig, kv: KVCacheManager) -> None:
        self.config = config
        self.kv = kv
        overhead = config.step_overhead_tokens
        self.step_overhead_tokens = (
            step_overhead_tokens_for(config.device) if overhead is None else overhead
        )
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in admission order: the last one is the newest
        # The last step could not admit a waiting request (the watermark, the free blocks):
        # nothing goes ahead of it until one is admitted again, so no prompt waits forever.
        self._admission_blocked = False
        self._backlog: bool | None = None  # this step's _has_backlog(), once asked

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def add_running(self, request: Request) -> None:
        """A request whose prompt KV arrived from elsewhere joins the batch directly."""
        request.status = "running"
        self.running.append(request)

    def remove(self, request: Request) -> None:
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)

    @property
    def num_queued_tokens(self) -> int:
        """Prompt tokens still to be computed, waiting or in flight: the prefill load signal.
        A waiting prompt counts past the prefix it would hit now, as the router counts what it
        places (its prefix index's hits left out): counted whole, a prompt that waited across a
        heartbeat left tokens the router never placed in the worker's reported load, and a
        prompt over the router's budget waited for the next heartbeat at an idle worker."""
        queued = sum(r.num_tokens - self._cached_tokens(r) for r in self.waiting)
        return queued + self._running_prefill_tokens()

    def _running_prefill_tokens(self) -> int:
        """Prompt tokens the running prefills have still to compute."""
        return sum(
            r.num_tokens - r.num_computed_tokens for r in self.running if r.num_output_tokens == 0
        )

    def schedule(self) -> list[ScheduledRequest]:
        budget = self.config.chunk_size
        batch: list[ScheduledRequest] = []
        # Waiting prompts whose whole prefill fits in half the step go ahead of partial
        # prefills and of longer waiting prompts: a short prompt that lands behind a long one
        # gets its first token after one step, not after the long one's whole prefill. They
        # take at most half of a step, so the long ones keep the rest of what the decodes
        # leave; decodes are never held back.
        jumping = [] if self._admission_blocked else self._finishing_now(budget // 2)
        self._admission_blocked = False
        self._backlog = None
        reserved = sum(r.num_tokens for r in jumping)
        # Running requests first: decodes (1 token) and the next chunk of partial prefills.
        for request in list(self.running):
            if budget == 0:
                break
            if request not in self.running:  # preempted by an earlier iteration
                continue
            remaining = request.num_tokens - request.num_computed_tokens
            num_new = min(remaining, budget if remaining == 1 else budget - reserved)
            if num_new <= 0:  # a partial prefill, this step's rest reserved
                continue
            if not self._allocate_or_preempt(request, num_new, batch):
                continue
            batch.append(ScheduledRequest(request, num_new))
            budget -= num_new
        in_flight = self._blocks_in_flight()
        for request in jumping:
            if budget <= 0 or len(self.running) >= self.config.max_num_seqs:
                break
            if self._waits_for(request, in_flight):
                continue
            if not self._joins_step(request, budget, batch):
                break
            if not self._admit(request, budget, batch):
                break
            self.waiting.remove(request)
            budget -= batch[-1].num_new_tokens
            in_flight.update(self.kv.blocks_in_flight(request))
        # Then admit waiting requests while budget, sequence slots and the watermark allow.
        passed_over: list[Request] = []
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            if self._waits_for(self.waiting[0], in_flight):
                passed_over.append(self.waiting.popleft())
                continue
            if not self._joins_step(self.waiting[0], budget, batch):
                break
            if not self._admit(self.waiting[0], budget, batch):
                break
            admitted = self.waiting.popleft()
            budget -= batch[-1].num_new_tokens
            in_flight.update(self.kv.blocks_in_flight(admitted))
        self.waiting.extendleft(reversed(passed_over))
        return batch

    def _blocks_in_flight(self) -> set[bytes]:
        """The prompt blocks running prefills have still to fill and register."""
        in_flight: set[bytes] = set()
        for request in self.running:
            if request.num_computed_tokens < request.num_prompt_tokens:
                in_flight.update(self.kv.blocks_in_flight(request))
        return in_flight

    def _waits_for(self, request: Request, in_flight: set[bytes]) -> bool:
        """A waiting request whose next uncached block a running prefill is filling waits for
        it: it then finds the shared prefix cached instead of computing it a second time (a
        burst of prompts behind one system prompt that no cache holds yet computes the prompt
        once, not once each). A request that holds blocks already (a peer fetch's) goes on."""
        if not in_flight or request.block_ids:
            return False
        return self.kv.first_missed_block(request) in in_flight

    def _joins_step(self, request: Request, budget: int, batch: list[ScheduledRequest]) -> bool:
        """Whether a waiting prompt whose prefill would complete in this step joins it.

        Under a backlog (_has_backlog) it does: packing steps serves the queue soonest. A
        burst one step could take is split to keep the sum of the first-token waits small:
        joining delays the prompts completing in the step already by its compute; waiting for
        the next step delays it, and each other waiting prompt, by one more step's fixed cost
        (step_overhead_tokens, in prompt tokens' compute). It joins when that is the
        larger delay. On a CPU, where compute grows with the tokens, a few prompts arriving
        together spread over a few steps; where the fixed cost dominates (a GPU: 0, not
        weighed) every prompt that fits joins. A prompt that would not complete (a long one's
        chunk) always joins: its first token is steps away either way."""
        overhead_tokens = self.step_overhead_tokens
        if overhead_tokens == 0:  # a GPU's: nothing to weigh on the admission path
            return True
        completing = sum(
            item.completes_pass and item.request.num_output_tokens == 0 for item in batch
        )
        if completing == 0 or self._has_backlog():
            return True
        num_new = request.num_tokens - self._cached_tokens(request)
        if num_new > budget:
            return True
        num_behind = len(self.waiting) - 1  # every other waiting prompt
        return (1 + num_behind) * overhead_tokens >= completing * num_new

    def _has_backlog(self) -> bool:
        """More prompt tokens are to be computed (the rest of the running prefills, the waiting
        prompts past their cached prefixes) than one step takes. Packing is then what serves
        them soonest, and the queue seen here may understate the load: a router holds back
        what it has not forwarded yet."""
        if self._backlog is None:
            budget = self.config.chunk_size
            pending = self._running_prefill_tokens()
            for request in self.waiting:
                if pending > budget:
                    break
                pending += request.num_tokens - self._cached_tokens(request)
            self._backlog = pending > budget
        return self._backlog

    def _cached_tokens(self, request: Request) -> int:
        """The tokens of a waiting request that will not be computed: a prefix match's hits,
        or the blocks a peer fetch filled."""
        return request.num_computed_tokens if request.block_ids else self.kv.peek_prefix(request)

    def _finishing_now(self, budget: int) -> list[Request]:
        """Waiting requests, in order, whose whole prompts fit the budget together."""
        chosen: list[Request] = []
        slots = self.config.max_num_seqs - len(self.running)
        for request in self.waiting:
            if len(chosen) >= slots or budget == 0:  # past max_num_seqs: none
                break
            if request.num_tokens <= budget:
                chosen.append(request)
                budget -= request.num_tokens
        return chosen

    def _admit(self, request: Request, budget: int, batch: list[ScheduledRequest]) -> bool:
        """Admits a waiting request for up to budget tokens (adding it to the batch), or
        False when the watermark or the free blocks do not allow it."""
        if not request.block_ids:
            request.num_computed_tokens = self.kv.match_prefix(request)
            if request.first_scheduled_time_s is None:
                request.num_cached_tokens = request.num_computed_tokens
        num_new = min(request.num_tokens - request.num_computed_tokens, budget)
        if not self._can_admit(request, num_new):
            # A waiting request holds no blocks: keeping its prefix hits while it waits
            # would let several waiting heads pin every block, and nothing run again.
            self.kv.free(request)
            request.num_computed_tokens = 0
            self._admission_blocked = True
            return False
        self.kv.allocate_slots(request, num_new)
        request.status = "running"
        self.running.append(request)
        batch.append(ScheduledRequest(request, num_new))
        return True

    def watermark_limit(self) -> int:
        """The blocks in use past which no new work is admitted (while anything runs): the rest
        is room for running requests to grow."""
        return int(self.config.watermark * self.kv.pool.num_blocks)

    def _can_admit(self, request: Request, num_new: int) -> bool:
        pool = self.kv.pool
        num_new_blocks = self.kv.num_new_blocks_needed(request, num_new)
        within_watermark = pool.num_used_blocks + num_new_blocks <= self.watermark_limit()
        # An idle engine always admits one request, or a low watermark could stall forever.
        return num_new_blocks <= pool.num_free_blocks and (within_watermark or not self.running)

    def _allocate_or_preempt(
        self, request: Request, num_new: int, batch: list[ScheduledRequest]
    ) -> bool:
        """Allocates slots, preempting the newest running request until they fit; False if the
        request itself had to be preempted."""
        while not self.kv.allocate_slots(request, num_new):
            victim = self.running[-1]
            self._preempt(victim)
            if victim is request:
                return False
        return True

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self.kv.free(request)
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        request.status = "waiting"
        self.waiting.appendleft(request)
