"""The local cluster (`pdserve up`): Redis, N prefill and M decode workers and the router as
child processes, the machine's cores divided among the workers, stopped cleanly in order."""

from __future__ import annotations

import ctypes
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from pdserve.redis_server import RedisServer, free_port
from pdserve.registry import Registry, Role

WORKER_DRAIN_GRACE_S = 5.0  # a local cluster has no rolling updates to wait for


class ChildExited(RuntimeError):
    """A process of the cluster exited on its own; carries the tail of its log."""


@dataclass(frozen=True, slots=True)
class ClusterSpec:
    num_prefill: int = 1
    num_decode: int = 1
    model: str = "smollm2-135m"
    dtype: str = "float32"
    kv_backend: str = "auto"
    host: str = "127.0.0.1"
    http_port: int = 8000  # 0: a free port
    grpc_port: int = 50051
    num_cores: int = 0  # cores to divide among the workers; 0: all of this machine's
    warmup: bool = True
    with_router: bool = True
    router_args: tuple[str, ...] = ()  # more `pdserve router` flags (policy, admission, key)
    worker_args: tuple[str, ...] = ()  # more `pdserve prefill|decode` flags (TLS, ...)
    log_dir: Path | None = None
    startup_timeout_s: float = 300.0

    def threads_per_worker(self) -> int:
        """Torch threads per worker: the cores shared out, because workers that each take
        every core thrash each other."""
        cores = self.num_cores or os.cpu_count() or 1
        return max(1, cores // (self.num_prefill + self.num_decode))


@dataclass(slots=True)
class Child:
    name: str
    role: str  # the `pdserve` command it runs: router, prefill or decode
    process: subprocess.Popen[bytes]
    log_path: Path

    def log_tail(self, num_lines: int = 30) -> str:
        lines = self.log_path.read_text(errors="replace").splitlines()
        return "\n".join(lines[-num_lines:])


@dataclass(frozen=True, slots=True)
class RouterEndpoint:
    name: str
    host: str
    http_port: int
    grpc_port: int

    @property
    def http_url(self) -> str:
        return f"http://{self.host}:{self.http_port}"

    @property
    def grpc_address(self) -> str:
        return f"{self.host}:{self.grpc_port}"

    def is_healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.http_url}/health", timeout=2) as response:
                return response.status == 200
        except (urllib.error.URLError, OSError):
            return False


@dataclass(slots=True)
class LocalCluster:
    spec: ClusterSpec
    redis: RedisServer | None = None
    children: list[Child] = field(default_factory=list)
    router: RouterEndpoint | None = None  # the one `up` starts (with_router)
    log_dir: Path = field(init=False)

    def __post_init__(self) -> None:
        self.log_dir = self.spec.log_dir or Path(tempfile.mkdtemp(prefix="pdserve-up-"))
        self.log_dir.mkdir(parents=True, exist_ok=True)

    @property
    def redis_url(self) -> str:
        assert self.redis is not None, "start() first"
        return self.redis.url

    def start(self) -> LocalCluster:
        """Starts everything and waits until all of it serves; on any failure stops what
        started and raises."""
        from engine.loader import resolve_model

        spec = self.spec
        try:
            resolve_model(spec.model)  # convert a GGUF once here, not in every child at once
            self.redis = RedisServer(host=spec.host)
            for role, count in (("prefill", spec.num_prefill), ("decode", spec.num_decode)):
                for i in range(count):
                    self._spawn(f"{role}-{i}", [role, *self._worker_args(f"{role}-{i}")])
            if spec.with_router:  # starts while the workers load their models
                self.router = self._spawn_router("router", spec.router_args,
                                                 spec.http_port, spec.grpc_port)  # fmt: skip
            self._wait_ready([self.router] if self.router else [])
        except BaseException:
            self.stop()
            raise
        return self

    def add_router(self, name: str, args: tuple[str, ...] = ()) -> RouterEndpoint:
        """Another router on the same workers (e.g. a benchmark's other admission mode)."""
        router = self._spawn_router(name, args, 0, 0)
        self._wait_ready([router])
        return router

    def remove_router(self, router: RouterEndpoint) -> None:
        (child,) = [c for c in self.children if c.name == router.name]
        child.process.send_signal(signal.SIGTERM)
        _wait_or_kill(child.process, WORKER_DRAIN_GRACE_S + 15)
        self.children.remove(child)

    def _worker_args(self, worker_id: str) -> list[str]:
        spec = self.spec
        return [
            "--redis-url", self.redis_url, "--model", spec.model, "--dtype", spec.dtype,
            "--threads", str(spec.threads_per_worker()), "--host", spec.host, "--port", "0",
            "--metrics-port", "0", "--kv-backend", spec.kv_backend, "--worker-id", worker_id,
            "--drain-grace-s", str(WORKER_DRAIN_GRACE_S),
            "--warmup" if spec.warmup else "--no-warmup", *spec.worker_args,
        ]  # fmt: skip

    def _spawn_router(
        self, name: str, args: tuple[str, ...], http_port: int, grpc_port: int
    ) -> RouterEndpoint:
        host = self.spec.host
        router = RouterEndpoint(name, host, http_port or free_port(host),
                                grpc_port or free_port(host))  # fmt: skip
        self._spawn(name, [
            "router", "--redis-url", self.redis_url, "--model", self.spec.model, "--host", host,
            "--http-port", str(router.http_port), "--grpc-port", str(router.grpc_port), *args,
        ])  # fmt: skip
        return router

    def _spawn(self, name: str, args: list[str]) -> None:
        log_path = self.log_dir / f"{name}.log"
        with log_path.open("wb") as log:
            process = subprocess.Popen(
                [sys.executable, "-m", "pdserve.cli", *args],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                env=os.environ | {"TOKENIZERS_PARALLELISM": "false"},
                # Own session: Ctrl-C reaches only the launcher, which stops the cluster in
                # order; the children still die with the launcher if it is killed.
                start_new_session=True, preexec_fn=_die_with_parent,
            )  # fmt: skip
        self.children.append(Child(name, args[0], process, log_path))

    def _wait_ready(self, routers: list[RouterEndpoint]) -> None:
        registry = Registry(self.redis_url)
        wanted: dict[Role, int] = {"prefill": self.spec.num_prefill, "decode": self.spec.num_decode}
        deadline = time.monotonic() + self.spec.startup_timeout_s
        while True:
            self.check_alive()
            registered = all(len(registry.workers(r)) >= n for r, n in wanted.items())
            if registered and all(router.is_healthy() for router in routers):
                return
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"cluster not ready after {self.spec.startup_timeout_s:.0f} s; "
                    f"logs in {self.log_dir}"
                )
            time.sleep(0.2)

    def check_alive(self) -> None:
        for child in self.children:
            code = child.process.poll()
            if code is not None:
                raise ChildExited(
                    f"{child.name} exited with code {code}; the end of {child.log_path}:\n"
                    f"{child.log_tail()}"
                )

    def stop(self) -> None:
        """The router first (no new work), then decode workers (they drain, which may need
        prefill), then prefill workers, then Redis."""
        for role in ("router", "decode", "prefill"):
            group = [c for c in self.children if c.role == role]
            for child in group:
                if child.process.poll() is None:
                    child.process.send_signal(signal.SIGTERM)
            for child in group:
                _wait_or_kill(child.process, WORKER_DRAIN_GRACE_S + 15)
        self.children.clear()
        if self.redis is not None:
            self.redis.stop()
            self.redis = None

    def banner(self) -> str:
        assert self.router is not None, "the banner describes a cluster with its router"
        spec, url = self.spec, self.router.http_url
        body = json.dumps({
            "model": spec.model, "max_tokens": 32, "temperature": 0,
            "messages": [{"role": "user", "content": "What is the capital of France?"}],
        })  # fmt: skip
        return "\n".join([
            f"pdserve is up: {spec.num_prefill} prefill + {spec.num_decode} decode worker(s), "
            f"{spec.threads_per_worker()} thread(s) each, model {spec.model} ({spec.dtype})",
            f"  OpenAI API  {url}/v1",
            f"  gRPC        {self.router.grpc_address}  (pdserve.v1.Generation)",
            f"  metrics     {url}/metrics",
            f"  workers     {url}/admin/workers",
            f"  Redis       {self.redis_url}",
            f"  logs        {self.log_dir}",
            "Try:",
            f"  curl {url}/v1/chat/completions -H 'Content-Type: application/json' -d '{body}'",
            "Ctrl-C stops everything.",
        ])  # fmt: skip


def run_until_signalled(cluster: LocalCluster, echo: Callable[[str], None]) -> int:
    """`pdserve up`: start, print the banner, serve until Ctrl-C/SIGTERM or a child dies."""

    def interrupt(*_: object) -> None:
        raise KeyboardInterrupt

    # SIGINT too: a launcher started in the background inherits it ignored.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, interrupt)
    code = 0
    try:
        cluster.start()
        echo(cluster.banner())
        while True:
            cluster.check_alive()
            time.sleep(0.5)
    except KeyboardInterrupt:
        echo("stopping the cluster...")
    except (ChildExited, TimeoutError) as e:
        echo(f"pdserve up failed: {e}")
        code = 1
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):  # a second Ctrl-C must not cut stop() short
            signal.signal(sig, signal.SIG_IGN)
        cluster.stop()
    echo("stopped.")
    return code


def _wait_or_kill(process: subprocess.Popen[bytes], timeout_s: float) -> None:
    try:
        process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def _libc_prctl() -> Callable[..., int] | None:
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):  # not Linux
        return None


# Resolved here, not in the forked child: loading a library there could deadlock.
_PRCTL = _libc_prctl()
_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM when the launcher dies (Linux), so a killed launcher
    leaves no workers behind."""
    if _PRCTL is not None:
        _PRCTL(_PR_SET_PDEATHSIG, signal.SIGTERM)
