"""Request-level pools for traces of hours: each prefill worker a FIFO server of whole prompts,
each decode worker a continuous batch whose step time is the cost model's for its batch, on a
fixed tick; workers added (after a start-up delay) and drained (removed once idle) on request.

Why not the engine-level simulator (sim/cluster.py): a 70B decode step is ~20 ms, so two hours
are ~360,000 real scheduler steps per decode worker, tens of minutes of Python per run. Here a
tick costs the same whatever the batch, and the step times are the same cost model's
(`CostModel.step_s`, `prefill_alone_s`). What it leaves out: the router's admission queue rules
and placement policies (prompts wait in one FIFO queue for the first free prefill worker;
decode goes to the worker with the fewest running requests), chunks of several prompts sharing
a prefill step, KV capacity (a worker holds at most max_num_seqs requests), and preemption."""

from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass, field

from planner.connector import Connector, LoadSource, Observation, PrefillFlow
from planner.settings import PoolName
from sim.costs import CostModel, StepShape
from sim.scale import prefill_alone_s


@dataclass(slots=True)
class FleetRequest:
    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    first_token_s: float | None = None
    done_s: float | None = None

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_s is None else self.first_token_s - self.arrival_s

    @property
    def itl_s(self) -> float | None:
        """Mean time between the output tokens after the first (None for a one-token output)."""
        if self.done_s is None or self.first_token_s is None or self.output_tokens < 2:
            return None
        return (self.done_s - self.first_token_s) / (self.output_tokens - 1)

    def meets(self, ttft_target_s: float, itl_target_s: float) -> bool:
        itl = self.itl_s
        ttft = self.ttft_s
        if self.done_s is None or ttft is None:
            return False
        return ttft <= ttft_target_s and (itl is None or itl <= itl_target_s)


@dataclass(slots=True)
class _Worker:
    created_s: float
    ready_s: float
    draining: bool = False
    removed_s: float | None = None

    def serves(self, now_s: float) -> bool:
        return not self.draining and now_s >= self.ready_s


@dataclass(slots=True)
class _PrefillWorker(_Worker):
    free_s: float = 0.0  # when the prompt it is computing (if any) is done
    started_s: float = 0.0  # when that prompt started
    prompt_tokens: int = 0  # its length


@dataclass(slots=True)
class _DecodeWorker(_Worker):
    # Every running request advances one token per step, so one step counter serves them all:
    # a request ends when the counter reaches its joining value plus its remaining tokens.
    steps: float = 0.0
    context_tokens: float = 0.0  # KV the batch reads per step
    running: list[tuple[float, int, FleetRequest]] = field(default_factory=list)  # heap


@dataclass(frozen=True, slots=True)
class FleetConfig:
    tick_s: float = 0.02
    startup_s: float = 120.0  # a new worker loads its weights and warms up before serving
    chunk_tokens: int = 512
    max_num_seqs: int = 256
    ttft_target_s: float = 0.5
    itl_target_s: float = 0.05


@dataclass(slots=True)
class _Interval:
    """What the planner's next observation summarises."""

    num_arrived: int = 0
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft_sum_s: float = 0.0
    num_first: int = 0
    itl_sum_s: float = 0.0
    num_itl: int = 0
    num_finished: int = 0
    num_met: int = 0
    batch_per_worker_sum: float = 0.0
    num_ticks: int = 0


class Fleet(LoadSource, Connector):
    """The pools, their queues and the clock; also the planner's load source and connector."""

    def __init__(self, cost: CostModel, config: FleetConfig, prefill: int, decode: int) -> None:
        self.cost = cost
        self.config = config
        self.now_s = 0.0
        self.prefill: list[_PrefillWorker] = [_PrefillWorker(0.0, 0.0) for _ in range(prefill)]
        self.decode: list[_DecodeWorker] = [_DecodeWorker(0.0, 0.0) for _ in range(decode)]
        self.retired: list[_Worker] = []
        self.queue: deque[FleetRequest] = deque()  # waiting for a prefill worker
        self.prefilled: deque[FleetRequest] = deque()  # first token out, waiting for decode
        self.requests: list[FleetRequest] = []
        self._prefill_s: dict[int, float] = {}  # prompt length -> seconds (memo)
        self._interval = _Interval()
        self._seq = 0
        self._queued_tokens = 0  # prompt tokens in self.queue
        self._arrived_tokens = 0  # prompt tokens arrived so far
        self._flow_read: tuple[float, int] | None = None  # (time, arrived tokens) last read

    # ---- the planner's view ---------------------------------------------------------------
    def replicas(self) -> dict[PoolName, int]:
        return {"prefill": sum(not w.draining for w in self.prefill),
                "decode": sum(not w.draining for w in self.decode)}  # fmt: skip

    def serving(self) -> dict[PoolName, int]:
        return {"prefill": sum(w.serves(self.now_s) for w in self.prefill),
                "decode": sum(w.serves(self.now_s) for w in self.decode)}  # fmt: skip

    def set_replicas(self, pool: PoolName, count: int) -> None:
        workers: list = self.prefill if pool == "prefill" else self.decode
        live = [w for w in workers if not w.draining]
        for _ in range(count - len(live)):
            new = _PrefillWorker if pool == "prefill" else _DecodeWorker
            workers.append(new(self.now_s, self.now_s + self.config.startup_s))
        # Drain the newest first: a worker still starting holds nothing.
        surplus = sorted(live, key=lambda w: w.created_s, reverse=True)[: max(0, len(live) - count)]
        for worker in surplus:
            worker.draining = True

    def observe(self) -> Observation:
        i, self._interval = self._interval, _Interval()
        interval_s = max(i.num_ticks * self.config.tick_s, self.config.tick_s)
        return Observation(
            interval_s=interval_s, num_requests=i.num_arrived,
            prompt_tokens=i.prompt_tokens / i.num_arrived if i.num_arrived else 0.0,
            output_tokens=i.output_tokens / i.num_arrived if i.num_arrived else 0.0,
            ttft_s=i.ttft_sum_s / i.num_first if i.num_first else None,
            itl_s=i.itl_sum_s / i.num_itl if i.num_itl else None,
            decode_batch_per_worker=i.batch_per_worker_sum / max(1, i.num_ticks),
            num_finished=i.num_finished, num_met_slo=i.num_met,
            queued_prompt_tokens=self.queued_prompt_tokens(),
        )  # fmt: skip

    def queued_prompt_tokens(self) -> float:
        """What the prefill workers' and the router's gauges would sum to: prompt tokens
        waiting, plus what is left to compute of the prompts in progress."""
        left = sum(w.prompt_tokens * (w.free_s - self.now_s) / (w.free_s - w.started_s)
                   for w in self.prefill if w.free_s > self.now_s > w.started_s)  # fmt: skip
        return self._queued_tokens + left

    def prefill_flow(self) -> PrefillFlow:
        """Arrivals counted where they arrive, which is what prefilled + the queue's growth
        amounts to."""
        last = self._flow_read
        self._flow_read = (self.now_s, self._arrived_tokens)
        elapsed_s = 0.0 if last is None else self.now_s - last[0]
        arriving = (self._arrived_tokens - last[1]) / elapsed_s if last and elapsed_s > 0 else 0.0
        return PrefillFlow(self.queued_prompt_tokens(), arriving)

    def gpu_seconds(self, gpus_per_worker: dict[PoolName, int]) -> float:
        total = 0.0
        for pool, workers in (("prefill", self.prefill), ("decode", self.decode)):
            total += gpus_per_worker[pool] * sum(self.now_s - w.created_s for w in workers)
        for worker in self.retired:
            kind: PoolName = "prefill" if isinstance(worker, _PrefillWorker) else "decode"
            assert worker.removed_s is not None
            total += gpus_per_worker[kind] * (worker.removed_s - worker.created_s)
        return total

    # ---- time -----------------------------------------------------------------------------
    def arrive(self, request: FleetRequest) -> None:
        self.requests.append(request)
        self.queue.append(request)
        self._queued_tokens += request.prompt_tokens
        self._arrived_tokens += request.prompt_tokens
        i = self._interval
        i.num_arrived += 1
        i.prompt_tokens += request.prompt_tokens
        i.output_tokens += request.output_tokens

    def tick(self) -> None:
        """Advances the clock by one tick: prompts start and finish, decode batches step."""
        end_s = self.now_s + self.config.tick_s
        self._run_prefill(end_s)
        self._join_decode(end_s)
        for worker in self.decode:
            self._step_decode(worker, end_s)
        self._retire(end_s)
        i = self._interval
        serving = [w for w in self.decode if w.serves(end_s)]
        i.batch_per_worker_sum += sum(len(w.running) for w in serving) / max(1, len(serving))
        i.num_ticks += 1
        self.now_s = end_s

    def _run_prefill(self, end_s: float) -> None:
        serving = [w for w in self.prefill if w.serves(self.now_s)]
        while self.queue and serving:
            worker = min(serving, key=lambda w: w.free_s)
            request = self.queue[0]
            start_s = max(worker.free_s, request.arrival_s, worker.ready_s)
            if start_s >= end_s:
                return
            self.queue.popleft()
            self._queued_tokens -= request.prompt_tokens
            worker.started_s, worker.prompt_tokens = start_s, request.prompt_tokens
            worker.free_s = start_s + self._prefill_alone_s(request.prompt_tokens)
            last_chunk = (
                request.prompt_tokens % self.config.chunk_tokens or self.config.chunk_tokens
            )
            request.first_token_s = worker.free_s + self.cost.kv_transfer_s(last_chunk)
            self.prefilled.append(request)
            i = self._interval
            i.ttft_sum_s += request.first_token_s - request.arrival_s
            i.num_first += 1

    def _prefill_alone_s(self, prompt_tokens: int) -> float:
        seconds = self._prefill_s.get(prompt_tokens)
        if seconds is None:
            seconds = prefill_alone_s(self.cost, prompt_tokens, self.config.chunk_tokens)
            self._prefill_s[prompt_tokens] = seconds
        return seconds

    def _join_decode(self, end_s: float) -> None:
        serving = [w for w in self.decode if w.serves(self.now_s)]
        while self.prefilled and serving:
            request = self.prefilled[0]
            assert request.first_token_s is not None
            worker = min(serving, key=lambda w: len(w.running))
            if (
                request.first_token_s >= self.now_s
                or len(worker.running) >= self.config.max_num_seqs
            ):
                return  # FIFO: the head joins first
            self.prefilled.popleft()
            if request.output_tokens < 2:
                self._finish(request, request.first_token_s)
                continue
            self._seq += 1
            ends_at = worker.steps + request.output_tokens - 1
            heapq.heappush(worker.running, (ends_at, self._seq, request))
            worker.context_tokens += request.prompt_tokens + 1

    def _step_decode(self, worker: _DecodeWorker, end_s: float) -> None:
        if not worker.running:
            return
        batch = len(worker.running)
        shape = StepShape(num_decode=batch, decode_context=int(worker.context_tokens),
                          num_sampled=batch)  # fmt: skip
        step_s = self.cost.step_s(shape)
        steps = self.config.tick_s / step_s
        worker.steps += steps
        worker.context_tokens += batch * steps
        while worker.running and worker.running[0][0] <= worker.steps:
            ends_at, _, request = heapq.heappop(worker.running)
            worker.context_tokens -= request.prompt_tokens + request.output_tokens
            self._finish(request, end_s - (worker.steps - ends_at) * step_s)

    def _finish(self, request: FleetRequest, done_s: float) -> None:
        request.done_s = done_s
        i = self._interval
        i.num_finished += 1
        i.num_met += request.meets(self.config.ttft_target_s, self.config.itl_target_s)
        itl = request.itl_s
        if itl is not None:
            i.itl_sum_s += itl
            i.num_itl += 1

    def _retire(self, end_s: float) -> None:
        for workers in (self.prefill, self.decode):
            idle = [w for w in workers if w.draining and self._idle(w, end_s)]
            for worker in idle:
                workers.remove(worker)
                worker.removed_s = end_s
                self.retired.append(worker)

    @staticmethod
    def _idle(worker: _Worker, end_s: float) -> bool:
        if isinstance(worker, _PrefillWorker):
            return worker.free_s <= end_s
        assert isinstance(worker, _DecodeWorker)
        return not worker.running
