"""The local cluster (`pdserve up`): Redis, N prefill, M decode and K aggregated workers and R
router replicas as child processes, the machine's cores divided among the workers, each
restarted with backoff when it dies, all stopped cleanly in order."""

from __future__ import annotations

import ctypes
import itertools
import json
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import redis

from pdserve import phase
from pdserve.progress import Phases, StartupProgress
from pdserve.redis_server import RedisServer, free_port
from pdserve.registry import Registry, Role

# A worker stopped (Ctrl-C, or the planner's scale-down) finishes what it holds for this long:
# a few output streams of a CPU model, not a rolling update's minutes.
WORKER_DRAIN_GRACE_S = 30.0
SUPERVISE_EVERY_S = 0.5
Report = Callable[[str], None]
Progress = Callable[[Phases], None]


class ChildExited(RuntimeError):
    """A process of the cluster exited during start-up; carries the tail of its log."""


class ClusterShapeError(ValueError):
    """Worker counts that cannot serve a request; says why and which flags would fix it."""


def check_shape(num_prefill: int, num_decode: int, num_aggregated: int) -> None:
    """Raises ClusterShapeError for a shape the router could never serve, or serve while some
    pool sits idle: a decode worker has its prompts prefilled by a prefill worker, a prefill
    worker fills a decode worker's KV, and beside aggregated workers a lone pool gets nothing
    (router/admission/controller.py's Kind). Without this, such a cluster waited its whole
    start-up timeout for a router that never became healthy."""
    counts = {"--prefill": num_prefill, "--decode": num_decode, "--aggregated": num_aggregated}
    for flag, count in counts.items():
        if count < 0:
            raise ClusterShapeError(
                f"{flag} {count}: a worker count cannot be negative; use 0 or more"
            )
    if num_prefill + num_decode + num_aggregated == 0:
        raise ClusterShapeError("no workers: add --prefill 1 --decode 1, or --aggregated 1")
    if num_decode and not num_prefill:
        raise ClusterShapeError(
            "decode workers need a prefill worker: add --prefill 1, or "
            + ("--decode 0 to serve with the aggregated workers only" if num_aggregated
               else "serve with --aggregated 1 --decode 0")
        )  # fmt: skip
    if num_prefill and not num_decode:
        raise ClusterShapeError(
            "prefill workers need a decode worker: add --decode 1, or "
            + ("--prefill 0 to serve with the aggregated workers only" if num_aggregated
               else "serve with --aggregated 1 --prefill 0")
        )  # fmt: skip


@dataclass(frozen=True, slots=True)
class RestartPolicy:
    """How a process that died is started again: after backoff_s, doubled for every death in a
    row that came sooner than stable_after_s after its start (a crash loop), at most
    max_backoff_s, so a child that cannot start is retried, and logged, every max_backoff_s."""

    backoff_s: float = 1.0
    max_backoff_s: float = 30.0
    stable_after_s: float = 60.0


@dataclass(slots=True)
class Restarts:
    """One supervised process's history: when it started, and when its next start is due."""

    started_s: float = field(default_factory=time.monotonic)
    num_restarts: int = 0
    num_quick_deaths: int = 0  # deaths in a row within stable_after_s of a start
    due_s: float | None = None  # a restart is pending until then

    def schedule(self, policy: RestartPolicy, now_s: float) -> float:
        """The process was found dead at now_s: the delay before its restart."""
        quick = now_s - self.started_s < policy.stable_after_s
        self.num_quick_deaths = self.num_quick_deaths + 1 if quick else 1
        delay_s = min(policy.max_backoff_s, policy.backoff_s * 2 ** (self.num_quick_deaths - 1))
        self.due_s = now_s + delay_s
        return delay_s

    def restarted(self, now_s: float) -> None:
        self.num_restarts += 1
        self.started_s = now_s
        self.due_s = None


@dataclass(frozen=True, slots=True)
class ClusterSpec:
    num_prefill: int = 1
    num_decode: int = 1
    num_aggregated: int = 0  # decode workers that prefill locally (`decode --aggregated`)
    model: str = "smollm2-135m"
    dtype: str = "float32"
    kv_backend: str = "auto"
    host: str = "127.0.0.1"
    http_port: int = 8000  # 0: a free port
    grpc_port: int = 50051
    num_cores: int = 0  # cores to divide among the workers; 0: all of this machine's
    warmup: bool = True
    with_router: bool = True
    num_routers: int = 1  # replicas sharing the workers (router/replicas.py); ports in turn
    router_args: tuple[str, ...] = ()  # more `pdserve router` flags (policy, admission, key)
    worker_args: tuple[str, ...] = ()  # more `pdserve prefill|decode` flags (TLS, ...)
    log_dir: Path | None = None
    startup_timeout_s: float = 300.0
    restart: RestartPolicy = field(default_factory=RestartPolicy)

    def __post_init__(self) -> None:  # before anything starts, Redis included
        check_shape(self.num_prefill, self.num_decode, self.num_aggregated)
        if self.num_routers < 1:
            raise ClusterShapeError(f"--routers {self.num_routers}: a cluster needs a router")

    def threads_per_worker(self) -> int:
        """Torch threads per worker: the cores shared out, because workers that each take
        every core thrash each other."""
        cores = self.num_cores or os.cpu_count() or 1
        return max(1, cores // max(1, self.num_prefill + self.num_decode + self.num_aggregated))


@dataclass(slots=True)
class Child:
    name: str
    role: str  # the `pdserve` command it runs: router, prefill or decode
    args: list[str]  # its `pdserve` command line, to start it again the same way
    process: subprocess.Popen[bytes]
    log_path: Path
    restarts: Restarts = field(default_factory=Restarts)

    @property
    def phase_path(self) -> Path:
        return _phase_path(self.log_path)

    @property
    def registry_role(self) -> str:
        """The role it registers under: a decode child started `--aggregated` is aggregated."""
        return "aggregated" if "--aggregated" in self.args else self.role

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
    routers: list[RouterEndpoint] = field(default_factory=list)  # those `up` starts
    log_dir: Path = field(init=False)
    redis_restarts: Restarts = field(default_factory=Restarts)
    # The supervisor thread and stop() both change children and Redis: one at a time.
    _lock: threading.RLock = field(default_factory=threading.RLock)
    _stopping: bool = False
    _supervisor: threading.Thread | None = None
    _supervisor_stop: threading.Event = field(default_factory=threading.Event)

    def __post_init__(self) -> None:
        self.log_dir = self.spec.log_dir or Path(tempfile.mkdtemp(prefix="pdserve-up-"))
        self.log_dir.mkdir(parents=True, exist_ok=True)

    @property
    def redis_url(self) -> str:
        assert self.redis is not None, "start() first"
        return self.redis.url

    def start(self, progress: Progress | None = None) -> LocalCluster:
        """Starts everything and waits until all of it serves; on any failure stops what
        started and raises. A child that dies before the cluster is up is a configuration
        error (a port in use, a bad flag): start-up fails with its log instead of retrying.
        progress, when given, is called with every process's phase as start-up goes."""
        from engine.model_files import resolve_model

        spec = self.spec
        try:
            resolve_model(spec.model)  # convert a GGUF once here, not in every child at once
            if progress is not None:
                progress({"redis": "starting"})
            self.redis = RedisServer(host=spec.host)
            for role, count in (("prefill", spec.num_prefill), ("decode", spec.num_decode)):
                for i in range(count):
                    self._spawn(f"{role}-{i}", [role, *self._worker_args(f"{role}-{i}")])
            for i in range(spec.num_aggregated):  # a decode child: it stops with that group
                name = f"aggregated-{i}"
                self._spawn(name, ["decode", *self._worker_args(name), "--aggregated"])
            for i in range(spec.num_routers if spec.with_router else 0):  # while workers load
                # Given ports in turn (8000, 8001, ...); 0 stays "any free port".
                http_port, grpc_port = (p + i if p else 0 for p in (spec.http_port, spec.grpc_port))
                name = "router" if i == 0 else f"router-{i}"
                self.routers.append(
                    self._spawn_router(name, spec.router_args, http_port, grpc_port)
                )
            self._wait_ready(self.routers, self.children, self._all_registered, progress)
        except BaseException:
            self.stop()
            raise
        return self

    @property
    def router(self) -> RouterEndpoint | None:
        """The first router: the cluster's address when there is one replica."""
        return self.routers[0] if self.routers else None

    def add_router(self, name: str, args: tuple[str, ...] = ()) -> RouterEndpoint:
        """Another router on the same workers (e.g. a benchmark's other admission mode)."""
        with self._lock:
            router = self._spawn_router(name, args, 0, 0)
            child = self.children[-1]
        self._wait_ready([router], [child], lambda: True)
        return router

    def remove_router(self, router: RouterEndpoint) -> None:
        with self._lock:  # out of the list first: the supervisor must not restart it
            (child,) = [c for c in self.children if c.name == router.name]
            self.children.remove(child)
        child.process.send_signal(signal.SIGTERM)
        _wait_or_kill(child.process, WORKER_DRAIN_GRACE_S + 15)

    def worker_names(self, role: str) -> list[str]:
        """The prefill or decode workers running or starting (not aggregated ones)."""
        with self._lock:
            return [c.name for c in self.children if c.registry_role == role]

    def add_worker(self, role: str) -> str:
        """Starts one more prefill or decode worker (a planner's scale-up); its name. It
        serves once registered, and is supervised like the others."""
        with self._lock:
            if self._stopping:
                raise RuntimeError("the cluster is stopping")
            taken = {c.name for c in self.children}
            name = next(f"{role}-{i}" for i in itertools.count() if f"{role}-{i}" not in taken)
            self._spawn(name, [role, *self._worker_args(name)])
        return name

    def remove_worker(self, name: str) -> None:
        """Drains a worker out of the cluster (a planner's scale-down): out of supervision
        first, then SIGTERM, on which it leaves the registry, finishes what it holds (up to
        WORKER_DRAIN_GRACE_S) and exits. Returns at once; the wait runs in the background."""
        with self._lock:
            child = self.child(name)
            self.children.remove(child)
        child.process.send_signal(signal.SIGTERM)
        threading.Thread(target=_wait_or_kill, args=(child.process, WORKER_DRAIN_GRACE_S + 15),
                         name=f"drain-{name}", daemon=True).start()  # fmt: skip

    def child(self, name: str) -> Child:
        with self._lock:
            (found,) = [c for c in self.children if c.name == name]
            return found

    def signal_child(self, name: str, sig: signal.Signals = signal.SIGKILL) -> int | None:
        """Sends sig to a child's current process ("redis": the Redis server), a fault for
        the cluster to survive; its pid, or None while it is down (a restart pending)."""
        with self._lock:
            if name == "redis":
                process = self.redis.process if self.redis is not None else None
            else:
                process = self.child(name).process
            if process is None or process.poll() is not None:
                return None
            process.send_signal(sig)
            return process.pid

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
        # Fixed ports, also on a restart: clients keep the address they were given.
        self._spawn(name, [
            "router", "--redis-url", self.redis_url, "--model", self.spec.model, "--host", host,
            "--http-port", str(router.http_port), "--grpc-port", str(router.grpc_port), *args,
        ])  # fmt: skip
        return router

    def _spawn(self, name: str, args: list[str]) -> None:
        log_path = self.log_dir / f"{name}.log"
        self.children.append(Child(name, args[0], args, _popen(args, log_path, "wb"), log_path))

    def _all_registered(self) -> bool:
        registry = Registry(self.redis_url)
        spec = self.spec
        wanted: dict[Role, int] = {
            "prefill": spec.num_prefill, "decode": spec.num_decode,
            "aggregated": spec.num_aggregated,
        }  # fmt: skip
        return all(len(registry.workers(r)) >= n for r, n in wanted.items())

    def _wait_ready(
        self,
        routers: list[RouterEndpoint],
        children: list[Child],
        ready: Callable[[], bool],
        progress: Progress | None = None,
    ) -> None:
        deadline = time.monotonic() + self.spec.startup_timeout_s
        while True:
            _check_alive(children)
            healthy = {router.name: router.is_healthy() for router in routers}
            if progress is not None:
                progress({"redis": "ready"} | {c.name: _phase(c, healthy) for c in children})
            if ready() and all(healthy.values()):
                return
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"cluster not ready after {self.spec.startup_timeout_s:.0f} s; "
                    f"logs in {self.log_dir}"
                )
            time.sleep(0.2)

    def check_alive(self) -> None:
        """Raises ChildExited for the first child that has exited (start-up's check)."""
        with self._lock:
            _check_alive(self.children)

    # ---- supervision ------------------------------------------------------------------------
    def watch(self, report: Report) -> None:
        """Supervises the started cluster in a background thread until stop(): a child or Redis
        that dies is reported (exit code, log tail) and started again after its backoff; the
        others keep serving. A restarted worker registers itself again (same worker id), and
        after a Redis restart every worker's heartbeat writes its entry back."""
        assert self._supervisor is None, "watch() once"
        self._supervisor = threading.Thread(
            target=self._supervise_until_stopped, args=(report,), name="supervisor", daemon=True
        )
        self._supervisor.start()

    def _supervise_until_stopped(self, report: Report) -> None:
        while not self._supervisor_stop.wait(SUPERVISE_EVERY_S):
            try:
                self.supervise(report)
            except Exception as e:  # a supervisor that dies would leave the next death unseen
                report(f"supervisor error (retrying): {e!r}")

    def supervise(self, report: Report) -> None:
        """One pass: notice deaths, restart what is due."""
        with self._lock:
            if self._stopping:
                return
            now_s = time.monotonic()
            self._supervise_redis(report, now_s)
            for child in self.children:
                self._supervise_child(child, report, now_s)

    def _supervise_child(self, child: Child, report: Report, now_s: float) -> None:
        restarts, policy = child.restarts, self.spec.restart
        if restarts.due_s is None:
            code = child.process.poll()
            if code is None:
                return
            uptime_s = now_s - restarts.started_s
            delay_s = restarts.schedule(policy, now_s)
            self._deregister(child, report)
            tail = textwrap.indent(child.log_tail(20), "    ")
            report(
                f"{child.name} (pid {child.process.pid}) exited with {_describe_exit(code)} after "
                f"{uptime_s:.0f} s; restart #{restarts.num_restarts + 1} in {delay_s:.0f} s. "
                f"The end of {child.log_path}:\n{tail}"
            )
        elif now_s >= restarts.due_s:
            child.process = _popen(child.args, child.log_path, "ab")
            restarts.restarted(now_s)
            report(f"{child.name} restarted (pid {child.process.pid}, "
                   f"restart #{restarts.num_restarts})")  # fmt: skip

    def _deregister(self, child: Child, report: Report) -> None:
        """A dead worker's registry entry would keep it in rotation until its TTL ran out, and
        every request routed there meanwhile would fail: take it out now, as Kubernetes takes
        a dead pod out of its endpoints. Its restart registers again under the same id."""
        if child.role not in ("prefill", "decode"):
            return
        worker_id = child.args[child.args.index("--worker-id") + 1]
        try:
            Registry(self.redis_url).remove(child.registry_role, worker_id)  # type: ignore[arg-type]
        except redis.RedisError as e:  # Redis down too: the TTL still expires the entry
            report(f"could not remove {worker_id} from the registry: {e}")

    def _supervise_redis(self, report: Report, now_s: float) -> None:
        """Redis comes back on its port: every child was given its URL."""
        server, restarts, policy = self.redis, self.redis_restarts, self.spec.restart
        if server is None:
            return
        if restarts.due_s is None:
            code = server.process.poll()
            if code is None:
                return
            delay_s = restarts.schedule(policy, now_s)
            report(f"redis (pid {server.process.pid}, port {server.port}) exited with "
                   f"{_describe_exit(code)}; restart #{restarts.num_restarts + 1} in "
                   f"{delay_s:.0f} s")  # fmt: skip
        elif now_s >= restarts.due_s:
            server.stop()  # its temporary directory; the process is gone
            try:
                self.redis = RedisServer(host=server.host, port=server.port)
            except (RuntimeError, OSError) as e:  # the port still taken: try again later
                restarts.started_s = now_s  # a failed start counts as a quick death
                delay_s = restarts.schedule(policy, now_s)
                report(f"redis did not start on port {server.port}: {e}; retrying in "
                       f"{delay_s:.0f} s")  # fmt: skip
                return  # self.redis stays the dead one: the next pass retries when due
            restarts.restarted(now_s)
            report(
                f"redis restarted on port {server.port} (pid {self.redis.process.pid}, "
                f"restart #{restarts.num_restarts}); workers re-register on their heartbeat"
            )

    # ---- stopping ---------------------------------------------------------------------------
    def stop(self) -> None:
        """The router first (no new work), then decode workers (they drain, which may need
        prefill), then prefill workers, then Redis. Nothing is restarted from here on."""
        with self._lock:
            self._stopping = True
        for role in ("router", "decode", "prefill"):
            group = [c for c in self.children if c.role == role]
            for child in group:
                if child.process.poll() is None:
                    child.process.send_signal(signal.SIGTERM)
            for child in group:
                _wait_or_kill(child.process, WORKER_DRAIN_GRACE_S + 15)
        # The supervisor thread ends only now: children it started get SIGTERM (PDEATHSIG)
        # when the thread that forked them exits, which must not come before their turn.
        self._supervisor_stop.set()
        if self._supervisor is not None:
            self._supervisor.join()
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
        others = [
            f"  {r.name:<11} {r.http_url}/v1  gRPC {r.grpc_address}  (a replica: same workers)"
            for r in self.routers[1:]
        ]
        return "\n".join([
            f"pdserve is up: {spec.num_prefill} prefill + {spec.num_decode} decode + "
            f"{spec.num_aggregated} aggregated worker(s), "
            f"{spec.threads_per_worker()} thread(s) each, model {spec.model} ({spec.dtype})",
            f"  OpenAI API  {url}/v1",
            f"  gRPC        {self.router.grpc_address}  (pdserve.v1.Generation)",
            *others,
            f"  metrics     {url}/metrics",
            f"  workers     {url}/admin/workers",
            f"  Redis       {self.redis_url}",
            f"  logs        {self.log_dir}",
            "Try:",
            f"  curl {url}/v1/chat/completions -H 'Content-Type: application/json' -d '{body}'",
            "A process that dies is restarted (its log says why).",
            "Ctrl-C stops everything.",
        ])  # fmt: skip


def run_until_signalled(
    cluster: LocalCluster, echo: Report, after_start: Callable[[LocalCluster], None] | None = None
) -> int:
    """`pdserve up`: start, print the banner, serve (restarting children that die) until
    Ctrl-C or SIGTERM, then stop everything. Non-zero only when start-up failed. after_start
    (the planner, with `--planner`) runs once the cluster serves."""

    def interrupt(*_: object) -> None:
        raise KeyboardInterrupt

    # SIGINT too: a launcher started in the background inherits it ignored.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, interrupt)
    code = 0
    try:
        with StartupProgress(echo, live=sys.stdout.isatty()) as progress:
            cluster.start(progress)
        echo(cluster.banner())
        cluster.watch(echo)
        if after_start is not None:
            after_start(cluster)
        while True:
            time.sleep(3600)  # the signal handler ends the wait
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


def _phase_path(log_path: Path) -> Path:
    return log_path.with_suffix(".phase")


def _popen(args: list[str], log_path: Path, mode: str) -> subprocess.Popen[bytes]:
    """`pdserve ARGS` with its output in log_path ("ab" on a restart: the dead run's log stays
    above the new one's) and its start-up phase in the file beside it (pdserve.phase)."""
    _phase_path(log_path).unlink(missing_ok=True)  # starting, also after a restart
    with log_path.open(mode) as log:
        if mode == "ab":
            log.write(b"\n---- restarted by the pdserve launcher ----\n")
            log.flush()
        return subprocess.Popen(
            [sys.executable, "-m", "pdserve", *args],  # pdserve/__main__.py
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            env=os.environ | {"TOKENIZERS_PARALLELISM": "false",
                              _LAUNCHER_PID_ENV: str(os.getpid()),
                              phase.PHASE_FILE_ENV: str(_phase_path(log_path))},
            # Own session: Ctrl-C reaches only the launcher, which stops the cluster in
            # order; the children still die with the launcher if it is killed.
            start_new_session=True,
        )  # fmt: skip


def _check_alive(children: list[Child]) -> None:
    for child in children:
        code = child.process.poll()
        if code is not None:
            raise ChildExited(
                f"{child.name} exited with {_describe_exit(code)}; the end of "
                f"{child.log_path}:\n{child.log_tail()}"
            )


def _phase(child: Child, healthy_routers: dict[str, bool]) -> phase.Phase:
    """A worker writes its phase; a router has none of its own: ready once healthy."""
    if child.name in healthy_routers:
        return "ready" if healthy_routers[child.name] else "starting"
    return phase.read(child.phase_path)


def _describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"code {code} ({signal.Signals(-code).name})"
        except ValueError:
            pass
    return f"code {code}"


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


_PR_SET_PDEATHSIG = 1
_LAUNCHER_PID_ENV = "PDSERVE_LAUNCHER_PID"


def _die_with_parent(launcher_pid: int) -> None:
    """In the child, first thing after exec: SIGTERM when the launcher's thread that started
    it ends (Linux), so a killed launcher leaves no workers behind."""
    prctl = _libc_prctl()
    if prctl is not None:
        prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != launcher_pid:  # it died before the line above: follow it now
        sys.exit(f"the launcher (pid {launcher_pid}) is gone")
