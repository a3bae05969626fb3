"""The simulated cluster: real router objects (Gateway.job's limits, Admission with its queue,
aging and 429 rules, the routing policies, WorkerPool and Ledger) in front of SimWorkers, on
the virtual clock. Between them, the services' calls (decode-driven remote prefill, KV
shipped per finished chunk, streaming) are modelled as coroutines with the network as a cost
model; the rules those calls follow are the services' and the router's own functions. With
several routers, each is a full set of those objects with its ReplicaSync, and Redis between
them is a delay: a router's state reaches the others replica_sync_s after the change that
made it (its publish batching plus a push through Redis)."""

from __future__ import annotations

import asyncio
import gc
import time
from collections.abc import Callable, Coroutine, Generator
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

from engine import EngineConfig, SamplingParams
from engine import errors as engine_errors
from engine.request import Request, StepOutput
from pdserve.kv_events import BATCH_S, CacheStream
from pdserve.lengths import LENGTH_BUCKETS
from pdserve.registry import ROLES, Role, WorkerInfo
from prefill_service.request_path import Shipment, first_token_params, plan_prefix_fetch
from router.admission import Admission, Lease
from router.errors import InvalidRequestError, OverloadedError, UnavailableError
from router.gateway import Gateway, excluding
from router.heap import freeze_startup_heap
from router.ledger import Assignment, Ledger
from router.prefix_index import PrefixIndex
from router.replicas import ReplicaSync
from router.routing import build_policies
from router.settings import AdmissionSettings, RouterSettings, RoutingSettings
from router.workers import WorkerPool
from sim.clock import SimulationStalled
from sim.costs import CostModel
from sim.worker import CoreShare, SimWorker, WorkerSpec
from sim.workload import ClosedLoop, OpenLoop, RequestSource, Sequential, SimRequest

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class ClusterConfig:
    workers: tuple[WorkerSpec, ...]  # the router's own rules pick the pool for each request
    prefill_engine: EngineConfig  # prefill workers (and aggregated ones)
    decode_engine: EngineConfig
    admission: AdmissionSettings = field(default_factory=AdmissionSettings)
    routing: RoutingSettings = field(default_factory=RoutingSettings)
    heartbeat_s: float = 2.0  # a worker publishes its load every registry_ttl_s / 3
    registry_refresh_s: float = 0.5  # the router re-reads the registry this often
    num_routers: int = 1  # requests go to them in turn
    replica_sync_s: float = 0.003  # ReplicaSync.min_gap_s + a publish and its push
    max_sim_s: float = 3600.0  # a run still going at this virtual time is stuck


@dataclass(slots=True)
class Record:
    """One request's outcome, in virtual seconds from its send."""

    request_id: str
    client: int
    num_prompt_tokens: int
    max_tokens: int
    bucket: str = ""
    sent_s: float = 0.0
    status: int = 0  # 200, 400, 429, 503
    reason: str = ""  # a 429's RejectReason
    ttft_s: float | None = None
    e2e_s: float | None = None
    num_output_tokens: int = 0
    queue_wait_s: float | None = None
    dispatched_s: float | None = None  # left the admission queue (virtual time)
    prefill_worker: str = ""
    decode_worker: str = ""
    num_preemptions: int = 0

    @property
    def tpot_s(self) -> float | None:
        if self.ttft_s is None or self.e2e_s is None or self.num_output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.num_output_tokens - 1)


class RouterMeter:
    """CPU seconds (time.process_time) spent inside the router's own code; nested calls count
    once, so a dispatch inside a release is not counted twice.

    Garbage collections that begin inside a metered call are counted apart (gc_s) and left out
    of router_s. CPython collects when anyone's allocations trip its threshold and walks the
    whole process's tracked objects of that generation, and this process holds every simulated
    engine: at 1,024 workers the full passes that landed in router calls were mostly over the
    engines' requests and block tables, which no router holds (its own process collects only
    its own objects)."""

    def __init__(self) -> None:
        self.cpu_s = 0.0  # inside router calls, collections included
        self.gc_s = 0.0  # of cpu_s, collections that began inside a router call
        self.num_calls = 0
        self._depth = 0
        self._started = 0.0
        self._gc_started: float | None = None

    @property
    def router_s(self) -> float:
        return self.cpu_s - self.gc_s

    def on_collection(self, phase: str, info: dict[str, int]) -> None:
        """A gc.callbacks hook, installed while a simulation runs."""
        if phase == "start":
            self._gc_started = time.process_time() if self._depth else None
        elif self._gc_started is not None:
            self.gc_s += time.process_time() - self._gc_started
            self._gc_started = None

    def __enter__(self) -> RouterMeter:
        if self._depth == 0:
            self._started = time.process_time()
        self._depth += 1
        return self

    def __exit__(self, *exc: object) -> None:
        self._depth -= 1
        if self._depth == 0:
            self.cpu_s += time.process_time() - self._started
            self.num_calls += 1

    def call(self, fn: Callable[..., T], *args: Any) -> T:
        with self:
            return fn(*args)

    async def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Awaits coro, timing each of its resumptions (not the time it is suspended)."""
        return await _Metered(coro, self)


class _Metered:
    def __init__(self, coro: Coroutine[Any, Any, Any], meter: RouterMeter) -> None:
        self._coro = coro
        self._meter = meter

    def __await__(self) -> Generator[Any, Any, Any]:
        inner = self._coro.__await__()
        value: Any = None
        error: BaseException | None = None
        while True:
            try:
                with self._meter:
                    yielded = inner.send(value) if error is None else inner.throw(error)
            except StopIteration as stop:
                return stop.value
            value, error = None, None
            try:
                value = yield yielded
            except BaseException as e:  # delivered into the coroutine, as await would
                error = e


@dataclass(slots=True)
class _Transfer:
    """A remote prefill's KV on its way to the decode worker (PrefillJob's simulated twin)."""

    shipment: Shipment
    done_at: float = 0.0  # when the last block sent so far lands
    held_block_ids: list[int] = field(default_factory=list)  # referenced until settled


@dataclass(slots=True)
class _Sink:
    """The decode worker's output stream for one request, as the router sees it."""

    first: asyncio.Future[float]
    done: asyncio.Future[float]
    num_tokens: int = 0

    def on_output(self, output: StepOutput, now: float) -> None:
        if output.new_token_ids:
            self.num_tokens += len(output.new_token_ids)
            if not self.first.done():
                self.first.set_result(now)
        if output.finished and not self.done.done():
            if not self.first.done():  # ended without a token (abort)
                self.first.set_result(now)
            self.done.set_result(now)


@dataclass(slots=True)
class SimRouter:
    """One router replica: the real router objects, its replica sync without Redis."""

    pool: WorkerPool
    admission: Admission
    gateway: Gateway
    replicas: ReplicaSync
    prefixes: PrefixIndex
    sync_due: bool = False  # a publish is on its way


@dataclass(slots=True)
class Samples:
    queue_depth: list[tuple[float, dict[str, int]]] = field(default_factory=list)


class Simulation:
    def __init__(self, config: ClusterConfig, cost: CostModel, cores: CoreShare | None = None):
        self.config = config
        self.cost = cost
        self.cores = cores
        self.loop = asyncio.get_running_loop()
        self.workers: dict[str, SimWorker] = {}
        for spec in config.workers:
            engine = config.decode_engine if spec.kind == "decode" else config.prefill_engine
            worker = SimWorker(spec, engine, cost, self.loop, cores)
            if spec.kind == "prefill":
                worker.engine.on_computed = lambda r, w=worker: self._ship(w, r)
            self.workers[spec.worker_id] = worker
        self.registry: dict[Role, dict[str, WorkerInfo]] = {role: {} for role in ROLES}
        self.routers = [self._new_router(f"router-{i}") for i in range(config.num_routers)]
        self.meter = RouterMeter()
        self._num_served = 0
        # Prompt tokens placed on each prefill-side worker and not yet prefilled, per request:
        # the budget invariant's ground truth (max_over_budget).
        self.placed: dict[str, dict[str, int]] = {}
        self.max_over_budget = 0  # tokens, past the budget plus one request per router
        self.records: list[Record] = []
        self.samples = Samples()
        self.kv_links: dict[str, float] = {}  # prefill worker -> when its link is free
        self._transfers: dict[str, _Transfer] = {}
        self._background: list[asyncio.Task[None]] = []

    def _new_router(self, router_id: str) -> SimRouter:
        config, clock = self.config, self.loop.time
        pool = WorkerPool(
            config.admission.default_prefill_tokens_per_s,
            ledgers={"prefill": Ledger(clock=clock), "decode": Ledger(clock=clock)},
        )
        prefixes = PrefixIndex()
        policies = build_policies(config.routing, config.admission, prefixes)
        admission = Admission(config.admission, pool, policies, prefixes=prefixes, clock=clock)
        settings = RouterSettings(redis_url="sim://", admission=config.admission,
                                  routing=config.routing)  # fmt: skip
        gateway = Gateway(settings, None, pool, admission, None)  # type: ignore[arg-type]
        replicas = ReplicaSync(pool, "sim://", admission.dispatch, router_id, clock=clock)
        router = SimRouter(pool, admission, gateway, replicas, prefixes)
        if config.num_routers > 1:

            def changed(side: Role, assignment: Assignment) -> None:
                replicas.changed(side, assignment)
                self._sync_soon(router)

            pool.on_assign = changed
            admission.before_send = replicas.hold
        return router

    # ---- the control plane -----------------------------------------------------------------
    def _sync_soon(self, router: SimRouter) -> None:
        """ReplicaSync._publish_loop: a change is published after the batching gap, and every
        other router takes the state in as it arrives through Redis."""
        if not router.sync_due:
            router.sync_due = True
            self.loop.call_later(self.config.replica_sync_s, self._sync, router)

    def _sync(self, router: SimRouter, full: bool = False) -> None:
        with self.meter:
            router.sync_due = False
            message, told = router.replicas.message(full)
            for other in self.routers:
                if other is not router:
                    other.replicas.take_in(message)
            router.replicas.published(told, reached=True)

    def _place(self, worker_id: str, request_id: str, num_tokens: int) -> None:
        """Checks the budget invariant as work is placed: a worker holds at most its
        prompt-token budget plus one request per router (router/replicas.py)."""
        placed = self.placed.setdefault(worker_id, {})
        placed[request_id] = num_tokens
        if self.config.admission.mode == "pass_through":
            return
        largest = sorted(placed.values(), reverse=True)[: len(self.routers)]
        over = sum(placed.values()) - sum(largest) - self.config.admission.prefill_token_budget
        self.max_over_budget = max(self.max_over_budget, over)

    def _publish(self, worker: SimWorker) -> None:
        self.registry[worker.spec.kind][worker.worker_id] = worker.info()
        usage = 1.0 - worker.stats.num_free_blocks / worker.stats.num_blocks
        worker.timeline.kv_usage.append((self.loop.time(), usage))

    def _refresh(self) -> None:
        """RouterServer._refresh: take the registry's snapshot, then dispatch."""
        with self.meter:
            for router in self.routers:
                for role in ROLES:
                    router.pool.update(role, list(self.registry[role].values()))
                router.admission.dispatch()
        depth = {b: sum(r.admission.queue.depth(b) for r in self.routers) for b in LENGTH_BUCKETS}
        self.samples.queue_depth.append((self.loop.time(), depth))

    async def _heartbeat(self, worker: SimWorker, phase_s: float) -> None:
        await asyncio.sleep(phase_s)
        while True:
            self._publish(worker)
            await asyncio.sleep(self.config.heartbeat_s)

    async def _publish_cache_events(self, worker: SimWorker) -> None:
        """CacheEventPublisher and the routers' stream readers: the worker's prefix-cache
        changes (its pool's and its host tier's) reach every router's prefix index as the same
        numbered entries, one per BATCH_S at most (Redis between them takes no time here)."""
        stream, pool, tier = CacheStream(), worker.engine.pool, worker.engine.tier
        pool.record_events = True
        if tier is not None:
            tier.record_events = True
        while True:
            stream.mirror.apply(pool.take_cache_events(), tier.take_events() if tier else ())
            update = stream.next_entry(snapshot=stream.seq == 0 or stream.snapshot_due)
            if update is not None:
                stream.written(update)
                with self.meter:  # the routers' CPU: each reads every worker's stream
                    for router in self.routers:
                        router.prefixes.apply(worker.worker_id, f"{update.seq}-0", update)
            await asyncio.sleep(BATCH_S)

    async def _follow_registry(self) -> None:
        while True:
            await asyncio.sleep(self.config.registry_refresh_s)
            self._refresh()
            if self.loop.time() > self.config.max_sim_s:
                raise SimulationStalled(f"still running at {self.config.max_sim_s:.0f} s")

    def start(self) -> None:
        n = len(self.workers)
        for i, worker in enumerate(self.workers.values()):
            self._publish(worker)
            self._background.append(self.loop.create_task(worker.run()))
            phase = self.config.heartbeat_s * (i + 1) / (n + 1)
            self._background.append(self.loop.create_task(self._heartbeat(worker, phase)))
            self._background.append(self.loop.create_task(self._publish_cache_events(worker)))
        self._refresh()
        if len(self.routers) > 1:  # replicas hear of each other at once
            for router in self.routers:
                self._sync(router, full=True)
        self._background.append(self.loop.create_task(self._follow_registry()))
        # As the router process does once it serves (router.server.serve). Here the start-up
        # heap is mostly the simulated engines' (their KV blocks: millions at 1,024 workers),
        # which no router holds: left to the collector, its full passes over them landed in
        # the metered router calls.
        freeze_startup_heap()
        gc.callbacks.append(self.meter.on_collection)

    async def stop(self) -> None:
        gc.callbacks.remove(self.meter.on_collection)
        gc.unfreeze()  # the next simulation in this process can collect this one's heap
        for task in self._background:
            task.cancel()
        results = await asyncio.gather(*self._background, return_exceptions=True)
        for result in results:  # a background failure (a stall, a bug) fails the run
            if isinstance(result, BaseException) and not isinstance(result, asyncio.CancelledError):
                raise result

    # ---- workloads -----------------------------------------------------------------------
    async def run_open(self, arrivals: OpenLoop, source: RequestSource, seed: int) -> None:
        tasks = []
        for when, request in arrivals.arrivals(source, seed):
            await asyncio.sleep(max(0.0, when - self.loop.time()))
            tasks.append(self.loop.create_task(self.serve(request)))
        await self._gather(tasks)

    async def run_closed(self, closed: ClosedLoop, source: RequestSource | Sequential) -> None:
        remaining = [closed.num_requests]

        async def client(index: int) -> None:
            while remaining[0] > 0 and self.loop.time() < closed.duration_s:
                request = source.next(index)
                if request is None:  # a Sequential source with no more for this client
                    return
                remaining[0] -= 1
                if request.think_s:
                    await asyncio.sleep(request.think_s)
                record = await self.serve(request)
                if record.status == 429:  # back off as Retry-After says, then send the next
                    await asyncio.sleep(1.0)

        await self._gather([self.loop.create_task(client(i)) for i in range(closed.concurrency)])

    async def _gather(self, tasks: list[asyncio.Task[Any]]) -> None:
        """Waits for the workload, failing at once if a background task (a stall) fails. One
        callback per task: waiting on every task again after each completion (asyncio.wait)
        was quadratic, most of a 1,024-worker run's wall time."""
        outcome: asyncio.Future[None] = self.loop.create_future()
        pending = {task for task in tasks if not task.done()}

        def workload_done(task: asyncio.Task[Any]) -> None:
            pending.discard(task)
            if not pending and not outcome.done():
                outcome.set_result(None)

        def background_done(task: asyncio.Task[Any]) -> None:
            if not task.cancelled() and task.exception() is not None and not outcome.done():
                outcome.set_exception(task.exception())  # type: ignore[arg-type]

        for task in pending:
            task.add_done_callback(workload_done)
        for task in self._background:
            task.add_done_callback(background_done)
        if pending:
            await outcome
        for task in tasks:
            task.result()

    # ---- one request -----------------------------------------------------------------------
    async def serve(self, request: SimRequest) -> Record:
        hop = self.cost.hop_s
        record = Record(request.request_id, request.client, request.num_prompt_tokens,
                        request.max_tokens, sent_s=self.loop.time())  # fmt: skip
        self.records.append(record)
        await asyncio.sleep(hop)  # client -> router
        if self.cores is not None:  # the host processes' CPU for it, before it is placed
            await self.cores.request_arrived()
        router = self.routers[self._num_served % len(self.routers)]
        self._num_served += 1
        params = SamplingParams(max_tokens=request.max_tokens, temperature=0.0, ignore_eos=True)
        try:
            with self.meter:
                job = router.gateway.job(request.prompt_token_ids, lambda _room: params,
                                       self.loop.time())  # fmt: skip
                ticket = replace(job.ticket, request_id=request.request_id,
                                 arrival_s=self.loop.time())  # fmt: skip
            record.bucket = ticket.bucket
            while True:
                lease = await self.meter.run(router.admission.admit(ticket))
                record.queue_wait_s, record.dispatched_s = lease.queue_wait_s, self.loop.time()
                record.prefill_worker = lease.prefill.worker_id
                self._place(lease.prefill.worker_id, request.request_id, ticket.num_prompt_tokens)
                record.decode_worker = lease.decode.worker_id
                try:
                    await self._run_leased(request, params, lease, record)
                    return record
                except OverloadedError:  # Run._next: a full decode worker; try each other once
                    with self.meter:
                        excluded = excluding(ticket, lease.decode.worker_id, router.pool)
                    if excluded is None:
                        raise
                    ticket = replace(ticket, excluded_decode_ids=excluded)
                finally:
                    self.placed[lease.prefill.worker_id].pop(request.request_id, None)
                    self.meter.call(lease.end)
        except InvalidRequestError:
            record.status = 400
        except OverloadedError as e:
            record.status, record.reason = 429, e.reason
        except UnavailableError:
            record.status = 503
        return record

    async def _run_leased(self, request: SimRequest, params: SamplingParams, lease: Lease,
                          record: Record) -> None:  # fmt: skip
        hop = self.cost.hop_s
        sink = _Sink(self.loop.create_future(), self.loop.create_future())
        await asyncio.sleep(hop)  # router -> the decode (or aggregated) worker
        worker = self.workers[lease.decode.worker_id]
        try:
            # DecodeService with settings.aggregated, or a decode worker given the prompt
            # (DecodeRequest.prefill_here, the router's prefill overflow)
            if worker.spec.kind == "aggregated" or lease.prefill is lease.decode:
                await worker.between_steps()
                requests = [
                    worker.engine.add_request(request.request_id, request.prompt_token_ids, params)
                ]
            else:
                requests = await self._remote_prefill(request, params, lease, worker, sink)
        except engine_errors.InvalidRequestError:
            record.status = 400
            return
        except engine_errors.EngineBusyError as e:  # RESOURCE_EXHAUSTED, as upstream.error_of
            await asyncio.sleep(hop)  # decode -> router
            raise OverloadedError("decode_kv", str(e), 1.0) from e
        if not sink.done.done():
            worker.listen(request.request_id, lambda o: self._stream(sink, o))
            worker.kick()
        first_s = await sink.first
        await asyncio.sleep(max(0.0, first_s + hop - self.loop.time()))  # decode -> router
        self.placed[lease.prefill.worker_id].pop(request.request_id, None)
        self.meter.call(lease.end_prefill)
        record.ttft_s = first_s + 2 * hop - record.sent_s
        done_s = await sink.done
        record.e2e_s = done_s + 2 * hop - record.sent_s
        record.num_output_tokens = sink.num_tokens
        record.num_preemptions = sum(r.num_preemptions for r in requests)
        record.status = 200
        await asyncio.sleep(max(0.0, done_s + 2 * hop - self.loop.time()))  # -> the client

    async def _remote_prefill(self, request: SimRequest, params: SamplingParams, lease: Lease,
                              decode: SimWorker, sink: _Sink) -> list[Request]:  # fmt: skip
        """DecodeService._generate + PrefillService._prefill: reserve KV on the decode worker,
        prefill elsewhere with the blocks shipped as they finish, then commit."""
        hop, rid, prompt = self.cost.hop_s, request.request_id, request.prompt_token_ids
        await decode.between_steps()
        reserved = decode.engine.reserve_for_remote_prefill(rid, prompt, params)
        num_held_blocks = decode.engine.kv.first_remote_block(reserved)
        prefill = self.workers[lease.prefill.worker_id]
        await asyncio.sleep(hop)  # decode -> prefill: the Prefill RPC
        transfer = _Transfer(Shipment(num_held_blocks))
        transfer.held_block_ids += await self._fetch_prefix(prefill, prompt, num_held_blocks)
        finished: asyncio.Future[StepOutput] = self.loop.create_future()
        await prefill.between_steps()
        try:
            prefill_request = prefill.engine.add_request(rid, prompt,
                                                         first_token_params(params, 0))  # fmt: skip
            prefill_request.prefix_looked_up = True  # by _fetch_prefix's plan
        except engine_errors.EngineError:
            prefill.engine.kv.release(transfer.held_block_ids)
            decode.engine.abort_request(rid)
            raise
        self._transfers[rid] = transfer
        prefill.listen(rid, lambda o: o.finished and finished.set_result(o))
        prefill.kick()
        output = await finished
        del self._transfers[rid]
        # PrefillService._settle: once every send has landed the held blocks go back; then the
        # response takes one hop back to the decode worker.
        await asyncio.sleep(max(0.0, transfer.done_at - self.loop.time()))
        prefill.engine.kv.release(transfer.held_block_ids)
        prefill.kick()
        await asyncio.sleep(hop)
        await decode.between_steps()
        first = decode.engine.commit_remote_prefill(rid, output.new_token_ids[0])
        self._stream(sink, first)
        return [reserved, prefill_request]

    def _stream(self, sink: _Sink, output: StepOutput) -> None:
        """A worker's output for one request, on its way to the client: the host processes'
        work for its tokens runs beside the steps."""
        sink.on_output(output, self.loop.time())
        if self.cores is not None:
            self.cores.tokens_streamed(len(output.new_token_ids))

    async def _fetch_prefix(self, prefill: SimWorker, prompt: list[int],
                            num_held_blocks: int) -> list[int]:  # fmt: skip
        """PrefixFetcher.fetch: the prefix blocks the decode worker holds past the prefill
        worker's own hits are read over the link when that beats computing them (the same
        plan_prefix_fetch); the blocks are held until the request ends, as the service holds
        them. Returns them."""
        await prefill.between_steps()
        plan = plan_prefix_fetch(prefill.engine, prompt, num_held_blocks, prefill.fetch_costs,
                                 prefill.stats.prefill_tokens_per_s)  # fmt: skip
        if plan is None or plan.refused is not None:
            return []
        num_tokens = len(plan.dst_ids) * prefill.engine.kv.block_size
        seconds = self.cost.kv_transfer_s(num_tokens)
        await asyncio.sleep(seconds)
        prefill.fetch_costs.record(num_tokens * self.cost.kv_bytes_per_token, seconds)
        await prefill.between_steps()
        prefill.engine.kv.cache_prompt_blocks(prompt, len(plan.own_ids), plan.dst_ids)
        return plan.own_ids + plan.dst_ids

    def _ship(self, worker: SimWorker, request: Request) -> None:
        """PrefillService._ship_finished_blocks on the engine thread after a step: the blocks
        that became final are held and sent; the link carries one send at a time."""
        transfer = self._transfers.get(request.request_id)
        if transfer is None:
            return
        kv = worker.engine.kv
        final = transfer.shipment.take_final_blocks(request, kv)
        if final is None:
            return
        block_ids = request.block_ids[final]
        transfer.held_block_ids.extend(block_ids)
        now = worker.clock()  # the end of the step that computed them
        begins = max(now, self.kv_links.get(worker.worker_id, 0.0))
        done = begins + self.cost.kv_transfer_s(len(block_ids) * kv.block_size)
        self.kv_links[worker.worker_id] = transfer.done_at = done
