"""What every worker process shares: engine + KV agent start-up, the gRPC server with health and
reflection, Prometheus /metrics, warm-up, the registry heartbeat, and SIGTERM draining."""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from prometheus_client import Gauge, Histogram, start_http_server

import kvtransfer
from engine import LLMEngine, SamplingParams
from engine.engine_loop import EngineLoop
from engine.errors import EngineDiedError
from engine.llm_engine import EngineStats
from pdserve import keepalive, phase
from pdserve.kv_events import CacheEventPublisher
from pdserve.registry import Heartbeat, Registry, Role, WorkerInfo, WorkerLoad
from pdserve.tls import server_credentials
from pdserve.worker_settings import WorkerSettings

log = logging.getLogger(__name__)

# One role per process: Prometheus' pod/job labels tell the roles apart. The HPAs scale the
# prefill pool on queued prompt tokens and the decode pool on KV usage or running requests.
KV_BLOCKS_FREE = Gauge("pdserve_kv_blocks_free", "Free KV cache blocks")
KV_BLOCKS_USED = Gauge("pdserve_kv_blocks_used", "KV cache blocks in use")
KV_CACHE_USAGE = Gauge("pdserve_kv_cache_usage_ratio", "Fraction of KV cache blocks in use")
KV_BLOCKS_QUARANTINED = Gauge(
    "pdserve_kv_blocks_quarantined",
    "KV blocks held out of use because a remote writer did not confirm it stopped",
)
PREFILL_QUEUED_TOKENS = Gauge(
    "pdserve_prefill_queued_tokens", "Prompt tokens waiting for or in prefill (prefill workers)"
)
DECODE_RUNNING = Gauge(
    "pdserve_decode_running_requests", "Requests in the decode batch (decode workers)"
)
STEP_SECONDS = Histogram(
    "pdserve_engine_step_seconds", "Duration of one engine step",
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5),
)  # fmt: skip


# Threads beyond the request limit: health checks, reflection and quick rejections always run.
_SPARE_RPC_THREADS = 16
# After the engine died: how long failing requests get to send their error before the exit.
_DEATH_GRACE_S = 1.0
EXIT_ENGINE_DIED = 70  # EX_SOFTWARE: Kubernetes or the local launcher restarts the worker


def registry_entry(
    engine: LLMEngine, stats: EngineStats, *, role: Role, worker_id: str, address: str,
    metrics_url: str, kv_backend: str, peer_fetch: bool, max_concurrent_rpcs: int = 0,
) -> WorkerInfo:  # fmt: skip
    """What a heartbeat publishes: who and where the worker is, its engine's limits, and its
    load from stats (a snapshot the engine thread took, never the live scheduler)."""
    # What it takes at once before refusing: its RPC limit (0: none known), and a decode worker
    # also refuses a remote prefill past max_num_seqs sequences (reserve_for_remote_prefill).
    limits = (max_concurrent_rpcs, engine.config.max_num_seqs if role == "decode" else 0)
    return WorkerInfo(
        role=role, worker_id=worker_id, address=address, metrics_url=metrics_url,
        kv_backend=kv_backend, max_model_len=engine.max_model_len,
        chunk_size=engine.config.chunk_size, block_size=engine.config.block_size,
        load=WorkerLoad(
            queued_tokens=stats.num_queued_tokens,
            running_requests=stats.num_running_requests,
            waiting_requests=stats.num_waiting_requests,
            free_blocks=stats.num_free_blocks,
            total_blocks=stats.num_blocks,
            prefill_tokens_per_s=stats.prefill_tokens_per_s,
            host_load_s_per_token=stats.host_load_s_per_token,
        ),
        peer_fetch=peer_fetch, max_requests=min((n for n in limits if n > 0), default=0),
    )  # fmt: skip


class WorkerRuntime:
    def __init__(self, settings: WorkerSettings) -> None:
        self.settings = settings
        phase.report("loading")
        self.engine = LLMEngine(settings.engine)
        self.registry = Registry(settings.redis_url)
        self.cache_events = CacheEventPublisher(self.registry.redis, settings.worker_id)
        self.loop = EngineLoop(
            self.engine, on_step=self._observe_step, on_death=self._on_death,
            on_cache_events=self.cache_events.submit,
        )  # fmt: skip
        layout = kvtransfer.KVLayout.of(settings.engine.model, self.engine.kv_cache)
        bind_host = settings.host if settings.host not in ("0.0.0.0", "::") else None
        self.kv_agent = kvtransfer.create_agent(
            settings.kv_backend, settings.worker_id, self.engine.kv_cache, layout,
            host=bind_host or settings.advertise_host or "127.0.0.1",
        )  # fmt: skip
        self.health = health.HealthServicer()
        num_threads = settings.max_concurrent_rpcs + _SPARE_RPC_THREADS
        self.server = grpc.server(
            ThreadPoolExecutor(max_workers=num_threads, thread_name_prefix=f"{settings.role}-rpc"),
            options=[("grpc.max_receive_message_length", 64 << 20), *keepalive.SERVER_OPTIONS],
            maximum_concurrent_rpcs=num_threads,  # never more than there are threads for
        )
        self.port = 0
        self.metrics_port = 0
        self.service_names: list[str] = []
        # Called with the error when the engine thread dies, to fail what waits outside it.
        self.death_hooks: list[Callable[[BaseException], None]] = []
        self._exit = threading.Event()  # a signal, or the engine's death
        self._draining = threading.Event()
        self._in_flight = 0
        self._in_flight_lock = threading.Condition()
        self._heartbeat: Heartbeat | None = None

    # ---- start-up ---------------------------------------------------------------------------
    def start(self, services: list[tuple[Callable, object, str]]) -> WorkerRuntime:
        """services: (add_XServicer_to_server, servicer, full service name) per service."""
        for add, servicer, _ in services:
            add(servicer, self.server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        names = self.service_names = ["", *(name for _, _, name in services)]
        for name in names:
            self.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        reflection.enable_server_reflection(
            (*names[1:], health.SERVICE_NAME, reflection.SERVICE_NAME), self.server
        )
        bind = f"{self.settings.host}:{self.settings.port}"
        tls = self.settings.tls
        self.port = (
            self.server.add_secure_port(bind, server_credentials(tls))
            if tls.enabled
            else self.server.add_insecure_port(bind)
        )
        if self.port == 0:
            raise OSError(f"cannot bind gRPC on {self.settings.host}:{self.settings.port}")
        metrics_server, _ = start_http_server(self.settings.metrics_port, self.settings.host)
        self.metrics_port = metrics_server.server_port
        self.server.start()
        self.cache_events.start()
        self.loop.start()
        if self.settings.warmup:
            phase.report("warming")
            self.loop.call(self._warm_up)
        for name in names:
            self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        self._heartbeat = Heartbeat(self.registry, self.info, self.settings.registry_ttl_s).start()
        phase.report("ready")  # registered: the launcher's readiness check counts it now
        log.info("%s worker %s serving on %s", self.settings.role, self.settings.worker_id,
                 self.address)  # fmt: skip
        return self

    def _warm_up(self) -> None:
        """One prefill per length bucket and a few decode steps, before reporting SERVING, so
        no user request pays first-run costs."""
        engine = self.engine
        lengths = self.settings.length_buckets.representatives(engine.max_model_len - 4)
        started = time.perf_counter()
        for i, n in enumerate(lengths):
            prompt = [(7 * j + i) % 1000 + 100 for j in range(n)]
            engine.add_request(f"warmup-{i}", prompt, SamplingParams(max_tokens=3, temperature=0))
        while engine.has_unfinished_requests():
            engine.step()
        engine.kv.reset_cache()  # warm-up prompts must not occupy the prefix cache or its tier
        log.info("warm-up over %s-token prompts took %.1f s", lengths,
                 time.perf_counter() - started)  # fmt: skip

    # ---- identity and load ------------------------------------------------------------------
    @property
    def address(self) -> str:
        host = self.settings.advertise_host or self.settings.host
        return f"{host}:{self.port}"

    def info(self) -> WorkerInfo:
        self._refresh_gauges()
        host = self.settings.advertise_host or self.settings.host
        return registry_entry(
            self.engine, self.loop.stats, role=self.settings.role,
            worker_id=self.settings.worker_id, address=self.address,
            metrics_url=f"http://{host}:{self.metrics_port}/metrics",
            kv_backend=self.kv_agent.backend, peer_fetch=self.settings.peer_fetch,
            max_concurrent_rpcs=self.settings.max_concurrent_rpcs,
        )  # fmt: skip

    def _observe_step(self, seconds: float, batch_size: int) -> None:
        STEP_SECONDS.observe(seconds)
        self._refresh_gauges()

    def _refresh_gauges(self) -> None:
        """After every step, and on every heartbeat (aborts free blocks between steps)."""
        stats = self.loop.stats
        num_used = stats.num_blocks - stats.num_free_blocks
        KV_BLOCKS_FREE.set(stats.num_free_blocks)
        KV_BLOCKS_USED.set(num_used)
        KV_CACHE_USAGE.set(num_used / stats.num_blocks)
        KV_BLOCKS_QUARANTINED.set(stats.num_quarantined_blocks)
        role = self.settings.role
        if role != "decode":  # an aggregated worker has both signals
            PREFILL_QUEUED_TOKENS.set(stats.num_queued_tokens)
        if role != "prefill":
            DECODE_RUNNING.set(stats.num_running_requests)

    # ---- request admission and draining -------------------------------------------------------
    @contextmanager
    def serving(self, context: grpc.ServicerContext) -> Iterator[None]:
        """Wraps every RPC: refuses new work while draining or past the limit, counts work in
        flight."""
        limit = self.settings.max_concurrent_rpcs
        with self._in_flight_lock:
            if self._draining.is_set():
                context.abort(grpc.StatusCode.UNAVAILABLE, "worker is draining; retry elsewhere")
            if self._in_flight >= limit:
                context.abort(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"worker has {self._in_flight} requests in flight, its limit "
                    "(--max-concurrent-rpcs); retry elsewhere",
                )
            self._in_flight += 1
        try:
            yield
        finally:
            with self._in_flight_lock:
                self._in_flight -= 1
                self._in_flight_lock.notify_all()

    def drain(self) -> None:
        """Leave the registry, refuse new work, finish in-flight work within the grace period,
        then stop."""
        if self._draining.is_set():
            return
        self._draining.set()
        log.info("draining: %d requests in flight", self._in_flight)
        self.health.enter_graceful_shutdown()
        self._leave_registry()
        with self._in_flight_lock:
            self._in_flight_lock.wait_for(
                lambda: self._in_flight == 0, timeout=self.settings.drain_grace_s
            )
        self.stop()

    def stop(self, grace_s: float = 1.0) -> None:
        self._draining.set()
        self._leave_registry()
        self.server.stop(grace=grace_s).wait()
        self.loop.stop()
        self.kv_agent.close()

    def _leave_registry(self) -> None:
        if self._heartbeat is not None:
            try:
                self._heartbeat.stop()
            except Exception as e:  # Redis gone at shutdown: the TTL cleans up
                log.warning("could not remove registry entry: %s", e)
        self.cache_events.stop()

    def _on_death(self, error: BaseException) -> None:
        """Engine thread, as it dies: say so at once, everywhere, then let serve_forever exit.
        The loop has already failed every stream and queued call."""
        self._draining.set()
        for name in self.service_names:
            self.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        self._leave_registry()
        for hook in self.death_hooks:
            hook(error)
        self._exit.set()

    def serve_forever(self) -> int:
        """Blocks until SIGTERM/SIGINT, then drains and returns 0; or until the engine dies,
        then returns EXIT_ENGINE_DIED once the failing requests have had their error sent."""
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: self._exit.set())
        self._exit.wait()
        if isinstance(self.loop.error, EngineDiedError):
            with self._in_flight_lock:
                self._in_flight_lock.wait_for(lambda: self._in_flight == 0, _DEATH_GRACE_S)
            self.stop(grace_s=0.1)
            return EXIT_ENGINE_DIED
        self.drain()
        return 0
