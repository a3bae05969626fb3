"""A simulated worker: the real LLMEngine (scheduler, KV cache manager, block pool, step) with a
cost-model runner in place of the model, stepped by a coroutine on the virtual clock."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

from engine import EngineConfig, LLMEngine
from engine.kv_tier import HostKVTier, num_slots_for
from engine.request import StepOutput
from engine.scheduler import ScheduledRequest
from pdserve.registry import Role, WorkerInfo
from pdserve.worker_runtime import registry_entry
from prefill_service.request_path import FetchCosts
from sim.costs import CostModel, StepShape

OUTPUT_TOKEN_ID = 100  # every generated token; requests set ignore_eos, so length decides
EOS_TOKEN_ID = 2


@dataclass(frozen=True, slots=True)
class WorkerSpec:
    worker_id: str
    kind: Role  # what it registers as
    speed_factor: float = 1.0  # step time multiplier: 2.0 is a card half as fast


class StepClock:
    """The engine's clock: virtual time, plus the modelled length of the step in progress, so
    the engine stamps a step's start, its first tokens and its measured speed as a real one
    would."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self.offset_s = 0.0

    def __call__(self) -> float:
        return self._loop.time() + self.offset_s


class SimTokenizer:
    """What the engine asks of a tokenizer once prompts arrive as token ids: the EOS id, and a
    decode for the detokenizer (text is not simulated)."""

    eos_token_id = EOS_TOKEN_ID

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return ""


@dataclass(slots=True)
class _Running:
    """A step in progress, or a burst of the host processes' work: its work left, in seconds
    it would take alone."""

    work_s: float
    ratio: float  # its shape's step time beside a neighbour over alone (1: not measured)
    threads: int  # the cores it keeps busy
    is_step: bool
    done: asyncio.Future[None] | None = None  # set when its work is done
    timer: asyncio.TimerHandle | None = None


@dataclass(slots=True)
class CoreShare:
    """Local cost model: how the workers' steps, and the other processes' work, share the
    machine, as the kernel's scheduler shares it. Everything in progress progresses together
    (processor sharing): a step keeps threads_per_step cores busy (the workers' torch threads),
    a burst of host work one; beyond the cores each thread gets cores / threads of one, except
    that a step of several threads goes at the pace of the one on the busiest core (they meet
    at a barrier after every operation: in traces of an aggregated worker on every core, the
    step that ran while the router took a request lasted longer than processor sharing gave
    it); below, each has its cores, but steps share memory bandwidth and caches, which slows a
    step beside another worker's by what calibration measured (beside: the cost fitted with a
    neighbour stepping on another core; None: not measured). Rates change whenever anything
    starts or ends, so a long step that began among others speeds up once they finish, as it
    does on the real cores.

    The host work is the router's, the client's and Redis's CPU, measured in situ
    (sim/validate.py) and split as it falls: host_cpu_s_per_request as one burst when each
    request arrives, which the request waits for before the router places it (the real router
    parses and places a request before it forwards it, so that work runs beside the steps in
    progress, not beside the request's own prefill), and host_cpu_s_per_token as a burst beside
    the steps for each token streamed, which nothing waits for (the router and the client
    handle each token as it comes; in a closed loop the end of one stream and the next request
    come at once)."""

    num_cores: int
    beside: CostModel | None = None
    alone: CostModel | None = None  # the cost fitted without a neighbour, beside's baseline
    threads_per_step: int = 1
    host_cpu_s_per_request: float = 0.0
    host_cpu_s_per_token: float = 0.0
    _running: list[_Running] = field(default_factory=list)
    _since: float = 0.0  # when the rates last changed

    @property
    def num_busy(self) -> int:
        return sum(r.is_step for r in self._running)

    def slowdown(self, shape: StepShape) -> float:
        """A step about to start, if what is running now ran throughout it: the estimate the
        engine's clock stamps the step with (its end comes from run())."""
        step = _Running(0.0, self._ratio(shape), self.threads_per_step, True)
        return 1.0 / self._rate(step, [*self._running, step])

    async def request_arrived(self) -> None:
        """The host processes' work for one request before it is placed, run beside the
        steps; returns when it is done."""
        if self.host_cpu_s_per_request > 0:
            await self._host_burst(self.host_cpu_s_per_request)

    def tokens_streamed(self, num_tokens: int) -> None:
        """The host processes' work for tokens streamed to the client, run beside the steps;
        nothing waits for it."""
        if self.host_cpu_s_per_token > 0 and num_tokens > 0:
            self._host_burst(self.host_cpu_s_per_token * num_tokens)

    def _host_burst(self, seconds: float) -> asyncio.Future[None]:
        loop = asyncio.get_running_loop()
        burst = _Running(seconds, 1.0, 1, False, loop.create_future())
        self._reshare(loop, add=burst)
        assert burst.done is not None
        return burst.done

    def _ratio(self, shape: StepShape) -> float:
        if self.beside is None or self.alone is None:
            return 1.0
        return self.beside.step_s(shape) / self.alone.step_s(shape)

    def _rate(self, item: _Running, running: list[_Running]) -> float:
        """Alone-seconds of work done per second by item among running (item included)."""
        num_threads = sum(r.threads for r in running)
        share = min(1.0, self.num_cores / num_threads)
        if item.is_step and item.threads > 1 and num_threads > self.num_cores:
            # Its threads meet at a barrier after every operation, so the step goes at the
            # pace of its slowest thread: the one on the busiest core.
            share = 1.0 / math.ceil(num_threads / self.num_cores)
        beside_a_step = item.is_step and sum(r.is_step for r in running) > 1
        return share / item.ratio if beside_a_step else share

    async def run(self, shape: StepShape, alone_s: float) -> None:
        """Runs a step of alone_s seconds' work among the others in progress."""
        loop = asyncio.get_running_loop()
        step = _Running(alone_s, self._ratio(shape), self.threads_per_step, True,
                        loop.create_future())  # fmt: skip
        self._reshare(loop, add=step)
        try:
            await step.done
        finally:
            if step in self._running:  # cancelled before it finished
                self._reshare(loop, remove=step)

    def _reshare(self, loop: asyncio.AbstractEventLoop, add: _Running | None = None,
                 remove: _Running | None = None) -> None:  # fmt: skip
        now = loop.time()
        for item in self._running:  # the work done at the old rates
            item.work_s -= (now - self._since) * self._rate(item, self._running)
            if item.timer is not None:
                item.timer.cancel()
        self._since = now
        if add is not None:
            self._running.append(add)
        if remove is not None:
            self._running.remove(remove)
        for item in self._running:
            left = max(0.0, item.work_s) / self._rate(item, self._running)
            item.timer = loop.call_at(now + left, self._finish, loop, item)

    def _finish(self, loop: asyncio.AbstractEventLoop, item: _Running) -> None:
        self._reshare(loop, remove=item)
        if item.done is not None:
            item.done.set_result(None)


class ModelledSlots:
    """The host KV tier's slots in the simulator (engine/kv_tier.py's SlotStore): the tier's
    own code decides what is stored, loaded and dropped; the slots hold no bytes and count the
    ones each copy would move, for the next step to take their time. The tier times its loads
    on copied_s, the modelled time of every copy so far."""

    def __init__(self, num_slots: int, block_bytes: int, bytes_per_s: float) -> None:
        self.num_slots, self.block_bytes = num_slots, block_bytes
        self.bytes_per_s = bytes_per_s
        self.num_pending_bytes = 0  # copied since the last step
        self.num_copied_bytes = 0  # copied in all

    def write(self, slot: int, block_id: int) -> bool:
        self._copy()
        return True

    def read(self, slot: int, block_id: int) -> bool:
        self._copy()
        return True

    def _copy(self) -> None:
        self.num_pending_bytes += self.block_bytes
        self.num_copied_bytes += self.block_bytes

    def copied_s(self) -> float:
        return self.num_copied_bytes / self.bytes_per_s

    def take_pending_bytes(self) -> int:
        """The bytes copied since the last call."""
        num_bytes, self.num_pending_bytes = self.num_pending_bytes, 0
        return num_bytes


class CostModelRunner:
    """ModelRunner's execute() contract: the next token of every request whose pass completes.
    The step's modelled duration goes to the step clock; the worker sleeps it afterwards. The
    host tier's copies are synchronous on the engine thread, as in the engine: those made while
    the step was scheduled (its prompts' loads, the evictions that made room), or between
    steps, lengthen the step."""

    def __init__(self, cost: CostModel, clock: StepClock, speed_factor: float,
                 cores: CoreShare | None, block_size: int) -> None:  # fmt: skip
        self.cost = cost
        self.clock = clock
        self.speed_factor = speed_factor
        self.cores = cores
        self.block_size = block_size
        self.tier_slots: ModelledSlots | None = None
        self.last_shape, self.last_alone_s = StepShape(), 0.0  # the step execute() modelled last

    def host_tier(self, capacity_bytes: int, path: str | None) -> HostKVTier:
        """ModelRunner.host_tier: the same tier, over slots that model the copies. path (a
        file on disk) is not modelled apart: the copies take host memory's time."""
        block_bytes = self.cost.kv_bytes_per_token * self.block_size
        slots = ModelledSlots(num_slots_for(capacity_bytes, block_bytes), block_bytes,
                              self.cost.host_copy_bytes_per_s)  # fmt: skip
        self.tier_slots = slots
        return HostKVTier(slots, "the simulator", clock=slots.copied_s)

    def execute(self, batch: Sequence[ScheduledRequest]) -> dict[str, int]:
        shape = StepShape.of(batch)
        seconds = self.cost.step_s(shape) * self.speed_factor
        if self.tier_slots is not None:
            seconds += self.tier_slots.take_pending_bytes() / self.cost.host_copy_bytes_per_s
        self.last_shape, self.last_alone_s = shape, seconds
        if self.cores is not None:
            seconds *= self.cores.slowdown(shape)
        self.clock.offset_s = seconds
        return {i.request.request_id: OUTPUT_TOKEN_ID for i in batch if i.completes_pass}


@dataclass(slots=True)
class Timeline:
    """Busy intervals and periodic KV samples, for utilisation and memory plots."""

    busy: list[tuple[float, float]] = field(default_factory=list)
    kv_usage: list[tuple[float, float]] = field(default_factory=list)

    def busy_s(self, start: float, end: float) -> float:
        return sum(max(0.0, min(b, end) - max(a, start)) for a, b in self.busy)


class SimWorker:
    def __init__(
        self, spec: WorkerSpec, config: EngineConfig, cost: CostModel,
        loop: asyncio.AbstractEventLoop, cores: CoreShare | None = None,
    ) -> None:  # fmt: skip
        if config.step_overhead_tokens is None:  # the modelled device's, not this host's
            config = replace(config, step_overhead_tokens=cost.step_overhead_tokens)
        self.spec = spec
        self.loop = loop
        self.clock = StepClock(loop)
        self.cores = cores
        self.runner = CostModelRunner(cost, self.clock, spec.speed_factor, cores,
                                      config.block_size)  # fmt: skip
        self.engine = LLMEngine(
            config, model_config=cost.model, tokenizer=SimTokenizer(),  # type: ignore[arg-type]
            runner=self.runner, clock=self.clock,  # type: ignore[arg-type]
        )  # fmt: skip
        self.listeners: dict[str, Callable[[StepOutput], None]] = {}
        self.fetch_costs = FetchCosts(cost.kv_bytes_per_token)  # reading a peer's prefix
        self.stats = self.engine.stats()
        self.timeline = Timeline()
        self.num_steps = 0
        self._wake = asyncio.Event()
        self._idle = False  # run() waits for work
        # The step begun and not yet run: its outputs, modelled seconds and start.
        self._begun: tuple[list[StepOutput], float, float] | None = None
        self._step_end: asyncio.Future[None] | None = None  # the step in progress, if any

    @property
    def worker_id(self) -> str:
        return self.spec.worker_id

    def kick(self) -> None:
        """Something changed outside a step (a request queued, committed, aborted). An idle
        worker starts its next step at once, as the real engine thread wakes on the command
        that queued the work: whatever reaches it later, even at the same virtual instant,
        waits for that step (between_steps) instead of joining it."""
        if self._idle and self._begun is None:
            self._begin_step()
        self._wake.set()

    def _begin_step(self) -> None:
        """Schedules and models the next step, if there is one to run: the engine's step()
        now, its modelled time spent by run()."""
        outputs = self.engine.step() if self.engine.has_unfinished_requests() else []
        seconds, self.clock.offset_s = self.clock.offset_s, 0.0
        if seconds > 0.0:  # 0: idle, or nothing schedulable until something changes
            self._begun = (outputs, seconds, self.loop.time())
            self._step_end = self.loop.create_future()

    async def between_steps(self) -> None:
        """EngineLoop.call: what the services ask of the engine waits for the step in
        progress to end, and runs before the next one starts."""
        while self._step_end is not None:
            await self._step_end

    def listen(self, request_id: str, listener: Callable[[StepOutput], None]) -> None:
        self.listeners[request_id] = listener

    def info(self) -> WorkerInfo:
        """The registry entry a heartbeat would publish now (EngineLoop's stats snapshot),
        stamped as Registry.publish stamps it."""
        entry = registry_entry(
            self.engine, self.stats, role=self.spec.kind, worker_id=self.worker_id,
            address=f"sim://{self.worker_id}", metrics_url="", kv_backend="sim", peer_fetch=True,
        )  # fmt: skip
        return replace(entry, updated_at=self.loop.time())

    async def run(self) -> None:
        """EngineLoop's loop on virtual time: step while there is work, sleep the step's
        modelled duration, then publish the stats snapshot and hand out the outputs."""
        while True:
            if self._begun is None:
                self._begin_step()
            if self._begun is None:
                self.stats = self.engine.stats()
                self._wake.clear()
                self._idle = True
                await self._wake.wait()
                self._idle = False
                continue
            outputs, seconds, started = self._begun
            self.num_steps += 1
            assert self._step_end is not None
            try:
                if self.cores is None:
                    await asyncio.sleep(max(0.0, started + seconds - self.loop.time()))
                else:
                    await self.cores.run(self.runner.last_shape, self.runner.last_alone_s)
            finally:
                self._begun = None
                self._step_end.set_result(None)
                self._step_end = None
            self.timeline.busy.append((started, self.loop.time()))
            self.stats = self.engine.stats()
            for output in outputs:
                listener = self.listeners.get(output.request_id)
                if listener is not None:
                    if output.finished:
                        del self.listeners[output.request_id]
                    listener(output)
            await asyncio.sleep(0)  # the commands that waited for this step run before the next
