"""Real processes for end-to-end tests: a Redis server and pdserve workers on loopback, or each
on its own host of a pdserve.netns Network (with a router process there too)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from typing import ClassVar

from prometheus_client.parser import text_string_to_metric_families

from pdserve.netns import Host
from pdserve.redis_server import RedisServer
from pdserve.registry import Registry, WorkerInfo
from tests.waiting import wait_until

PDSERVE = (sys.executable, "-m", "pdserve.cli")


@dataclass
class WorkerProcess:
    role: str
    worker_id: str
    process: subprocess.Popen
    info: WorkerInfo | None = None
    host: Host | None = None  # None: this machine's loopback

    @property
    def address(self) -> str:
        assert self.info is not None
        return self.info.address

    def kill(self) -> None:
        self.process.send_signal(signal.SIGKILL)
        self.process.wait(timeout=30)

    def terminate(self) -> None:
        self.process.send_signal(signal.SIGTERM)

    def metric(self, name: str, **labels: str) -> float:
        assert self.info is not None
        return metric(self.info.metrics_url, name, **labels)


def metric(metrics_url: str, name: str, **labels: str) -> float:
    """One sample from a Prometheus /metrics page (0.0 when not yet exported)."""
    return sample_value(urllib.request.urlopen(metrics_url, timeout=5).read().decode(), name,
                        **labels)  # fmt: skip


def sample_value(text: str, name: str, **labels: str) -> float:
    """The sample of that name with exactly those labels in a /metrics text, else 0.0."""
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and sample.labels == labels:
                return sample.value
    return 0.0


@dataclass
class RouterProcess:
    # Fixed: a router has its host (a network namespace) to itself.
    HTTP_PORT: ClassVar[int] = 8000
    GRPC_PORT: ClassVar[int] = 50051
    process: subprocess.Popen
    host: Host

    @property
    def http_url(self) -> str:
        return f"http://{self.host.address}:{self.HTTP_PORT}"

    @property
    def grpc_address(self) -> str:
        return f"{self.host.address}:{self.GRPC_PORT}"

    def metric(self, name: str, **labels: str) -> float:
        return metric(f"{self.http_url}/metrics", name, **labels)

    def sees(self, worker: WorkerProcess) -> bool:
        """The router's snapshot holds the worker's registry entry as registered (or newer):
        a worker restarted under a dead one's id is routable, not only registered."""
        assert worker.info is not None
        with urllib.request.urlopen(f"{self.http_url}/admin/workers", timeout=10) as response:
            views = json.load(response)["workers"]
        registered_at = worker.info.updated_at - 0.01  # heartbeat_age_s is rounded to 1 ms
        return any(v["worker_id"] == worker.worker_id
                   and time.time() - v["heartbeat_age_s"] >= registered_at
                   for v in views)  # fmt: skip


def on_host(host: Host | None) -> list[str]:
    """A server's flags to bind, and be known by, host's address."""
    return [] if host is None else ["--host", host.address, "--advertise-host", host.address]


@dataclass
class Cluster:
    kv_backend: str = "tcp"
    registry_ttl_s: float = 2.0
    # The fp32 path: the tests compare the workers' tokens with the fp32 llm fixture's.
    quantization: str = "none"
    extra_args: list[str] = field(default_factory=list)
    redis: RedisServer = field(default_factory=RedisServer)
    workers: list[WorkerProcess] = field(default_factory=list)
    routers: list[RouterProcess] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.registry = Registry(self.redis.url)

    def start(
        self, role: str, *args: str, wait: bool = True, program: tuple[str, ...] = PDSERVE,
        host: Host | None = None, worker_id: str | None = None,
    ) -> WorkerProcess:  # fmt: skip
        """program: how to run `pdserve` (tests/workers/faulty_worker.py injects faults);
        host: where (it binds and advertises that host's address); worker_id: a dead worker's,
        for one restarted in its place."""
        worker_id = worker_id or f"{role}-{len(self.workers)}"
        command = [
            *program, role, "--redis-url", self.redis.url,
            "--port", "0", "--metrics-port", "0", "--threads", "1", "--worker-id", worker_id,
            "--kv-backend", self.kv_backend, "--registry-ttl-s", str(self.registry_ttl_s),
            "--quantization", self.quantization, "--no-warmup", "--log-level", "warning",
            *on_host(host), *self.extra_args, *args,
        ]  # fmt: skip
        process = subprocess.Popen(host.command(command) if host else command)
        worker = WorkerProcess(role, worker_id, process, host=host)
        self.workers.append(worker)
        if wait:
            self.wait_registered(worker)
        return worker

    def entry(self, worker: WorkerProcess) -> WorkerInfo | None:
        """The worker's registry entry, None while it has none."""
        found = [w for w in self.registry.workers(worker.role) if w.worker_id == worker.worker_id]
        return found[0] if found else None

    def wait_registered(self, worker: WorkerProcess, timeout_s: float = 180.0) -> None:
        def registered() -> WorkerInfo | None:
            if (info := self.entry(worker)) is None and worker.process.poll() is not None:
                raise RuntimeError(f"{worker.worker_id} exited with {worker.process.returncode}")
            return info

        worker.info = wait_until(
            registered, timeout_s=timeout_s, interval_s=0.2,
            message=f"{worker.worker_id} did not register",
        )  # fmt: skip

    def wait_all_registered(self) -> None:
        """Waits for every worker not registered yet: workers started with wait=False side by
        side, so that their start-ups overlap."""
        for worker in self.workers:
            if worker.info is None:
                self.wait_registered(worker)

    def load(self, worker: WorkerProcess):
        """The worker's live load, as its next heartbeat publishes it: an entry published after
        this call (older ones may predate what the test just did)."""
        since = time.time()

        def fresh() -> WorkerInfo | None:
            info = self.entry(worker)
            return info if info is not None and info.updated_at > since else None

        return wait_until(
            fresh, timeout_s=60, interval_s=0.05,
            message=f"no heartbeat from {worker.worker_id} after {since:.3f}",
        ).load  # fmt: skip

    def assert_idle(self, *workers: WorkerProcess) -> None:
        """Every block free again, on every worker kind, and none quarantined."""
        for worker in workers:
            wait_until(
                lambda w=worker: self._is_idle(w), timeout_s=120,
                message=f"{worker.worker_id} never went idle",
            )  # fmt: skip
            assert worker.metric("pdserve_kv_blocks_quarantined") == 0
            assert worker.process.poll() is None, f"{worker.worker_id} died"

    def _is_idle(self, worker: WorkerProcess) -> bool:
        load = self.load(worker)
        return load.free_blocks == load.total_blocks and load.running_requests == 0

    def start_router(self, host: Host, *args: str) -> RouterProcess:
        """`pdserve router` on host, once it serves."""
        command = [
            *PDSERVE, "router", "--redis-url", self.redis.url, "--host", host.address,
            "--http-port", str(RouterProcess.HTTP_PORT),
            "--grpc-port", str(RouterProcess.GRPC_PORT),
            "--threads", "1", "--log-level", "warning", *args,
        ]  # fmt: skip
        router = RouterProcess(subprocess.Popen(host.command(command)), host)
        self.routers.append(router)

        def serving() -> bool:
            if router.process.poll() is not None:
                raise RuntimeError(f"the router exited with {router.process.returncode}")
            try:
                return urllib.request.urlopen(f"{router.http_url}/health", timeout=2).status == 200
            except OSError:  # not listening yet, or 503 until it sees both pools
                return False

        wait_until(serving, timeout_s=120, interval_s=0.2, message="the router never served")
        return router

    def stop(self) -> None:
        for router in self.routers:
            if router.process.poll() is None:
                router.process.kill()
                router.process.wait(timeout=30)
        for worker in self.workers:
            if worker.process.poll() is None:
                worker.process.kill()
                worker.process.wait(timeout=30)
        self.redis.stop()
