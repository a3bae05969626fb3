"""`pdserve up` as a supervisor: a killed worker, router or Redis is restarted while the rest
keeps serving (with two router replicas, the one not killed serves on), SIGTERM stops every
child, and a crash loop backs off up to its cap; a shape that cannot serve is refused before
anything starts."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from engine import LLM, SamplingParams
from pdserve.launcher import ClusterShapeError, RestartPolicy, Restarts, check_shape
from pdserve.phase import PHASES
from pdserve.registry import Registry
from tests.cluster import metric
from tests.waiting import wait_until

PROMPT_IDS = [(37 * i) % 3000 + 200 for i in range(48)]
MAX_TOKENS = 6
WAIT_S = 240.0  # model loads on two busy cores: generous, never a timing assertion


@dataclass
class Up:
    """A running `pdserve up` and everything it printed so far."""

    process: subprocess.Popen[str]
    http_urls: list[str]  # the router replicas', as the banner lists them
    redis_url: str
    lines: list[str] = field(default_factory=list)

    @property
    def http_url(self) -> str:
        return self.http_urls[0]

    def output(self) -> str:
        return "".join(self.lines)

    def children(self) -> dict[str, int]:
        """Child name (worker id, "router", "redis") -> pid, from /proc."""
        found = {}
        for pid, cmdline in _children_of(self.process.pid):
            if cmdline[1:3] == ["-m", "pdserve"]:  # `python -m pdserve ROLE ...`
                if "--worker-id" in cmdline:
                    name = cmdline[cmdline.index("--worker-id") + 1]
                else:  # a router: named by its place in the banner
                    port = cmdline[cmdline.index("--http-port") + 1]
                    index = [u.rsplit(":", 1)[1] for u in self.http_urls].index(port)
                    name = "router" if index == 0 else f"router-{index}"
                found[name] = pid
            elif Path(cmdline[0]).name.startswith(("redis-server", "valkey-server")):
                found["redis"] = pid
        return found

    def complete(self, router: int = 0) -> tuple[int, dict]:
        body = {"prompt": PROMPT_IDS, "max_tokens": MAX_TOKENS, "temperature": 0,
                "ignore_eos": True}  # fmt: skip
        request = urllib.request.Request(
            f"{self.http_urls[router]}/v1/completions", json.dumps(body).encode(),
            {"Content-Type": "application/json"},
        )  # fmt: skip
        try:
            with urllib.request.urlopen(request, timeout=300) as response:
                return response.status, json.load(response)
        except urllib.error.HTTPError as e:
            return e.code, json.load(e)


def _children_of(parent: int) -> list[tuple[int, list[str]]]:
    children = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes().decode().split("\0")
        except OSError:  # gone meanwhile
            continue
        # "pid (comm) state ppid ...": comm may hold spaces, so split after its ")".
        state, ppid = stat.rsplit(")", 1)[1].split()[:2]
        if int(ppid) == parent and state != "Z":
            children.append((int(entry.name), cmdline))
    return children


def _is_alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


@pytest.fixture(scope="module")
def expected_text() -> str:
    """The single-process engine's completion in the default configuration, as `up` starts its
    workers (on the CPU: the GGUF's int4 codes), before the cluster takes the cores."""
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    return LLM(num_threads=2, device="cpu").generate([PROMPT_IDS], params)[0].text


def start_up(log_dir: Path) -> Up:
    """Two prefill workers (one can be killed while the other serves), one decode worker and
    two router replicas, on ports the OS picks (listed in the banner)."""
    command = [
        sys.executable, "-m", "pdserve.cli", "up", "--prefill", "2", "--decode", "1",
        "--routers", "2", "--http-port", "0", "--grpc-port", "0", "--no-warmup",
        "--kv-backend", "tcp", "--cores", "2", "--restart-backoff-s", "0.5",
        "--log-dir", str(log_dir),
    ]  # fmt: skip
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True)  # fmt: skip
    lines: list[str] = []
    banner_done = threading.Event()

    def read() -> None:  # keeps the pipe drained for as long as `up` runs
        for line in process.stdout:
            lines.append(line)
            if line.startswith("Ctrl-C stops everything"):
                banner_done.set()
        banner_done.set()

    threading.Thread(target=read, daemon=True).start()
    banner_done.wait(timeout=600)
    text = "".join(lines)
    assert "pdserve is up" in text, text
    redis_url = re.search(r"Redis\s+(\S+)", text).group(1)
    first = re.search(r"OpenAI API\s+(\S+)/v1", text).group(1)
    replicas = re.findall(r"router-\d+\s+(\S+)/v1", text)
    return Up(process, [first, *replicas], redis_url, lines)


@pytest.fixture(scope="module")
def launched(expected_text: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[Up]]:
    """The module's `pdserve up`, started once (after expected_text, which needs the cores):
    a one-item list, replaced by the up fixture once the SIGTERM test has stopped it."""
    current = [start_up(tmp_path_factory.mktemp("pdserve-up"))]
    yield current
    if current[0].process.poll() is None:
        current[0].process.send_signal(signal.SIGTERM)
        current[0].process.wait(timeout=120)


@pytest.fixture
def up(launched: list[Up], tmp_path_factory: pytest.TempPathFactory) -> Up:
    """The running `pdserve up`; a new one if a test stopped the last, so tests run in any
    order."""
    if launched[0].process.poll() is not None:
        launched[0] = start_up(tmp_path_factory.mktemp("pdserve-up"))
    return launched[0]


def registered(up: Up) -> dict[str, str]:
    """worker id -> gRPC address, as the registry has them now."""
    registry = Registry(up.redis_url)
    try:
        return {w.worker_id: w.address for r in ("prefill", "decode") for w in registry.workers(r)}
    except Exception:  # Redis restarting
        return {}


def test_start_up_progress_shows_every_process_reaching_ready(up):
    # Not a terminal: one line per phase change, before the banner.
    seen: dict[str, list[str]] = {}
    for line in up.output().split("pdserve is up")[0].splitlines():
        name, phase = re.fullmatch(r"(\S+): (\w+) \(\d+ s\)", line).groups()
        seen.setdefault(name, []).append(phase)
    assert set(seen) == {"redis", "router", "router-1", "prefill-0", "prefill-1", "decode-0"}
    for name, phases in seen.items():  # a poll may miss a short phase, never reorder them
        assert phases[-1] == "ready", (name, phases)
        assert phases == sorted(set(phases), key=PHASES.index), (name, phases)
    assert "warming" not in {p for phases in seen.values() for p in phases}  # --no-warmup


def test_workers_run_the_default_quantization(up):
    """`up` names no --quantization: its workers run the default, the bundled GGUF's int4 codes
    on the CPU."""
    workers = [w for role in ("prefill", "decode") for w in Registry(up.redis_url).workers(role)]
    assert len(workers) == 3
    for worker in workers:
        weights = {"device": "cpu", "dtype": "int4", "tensor": "weights"}
        assert metric(worker.metrics_url, "pdserve_engine_tensors_info", **weights) == 1.0


def test_a_killed_prefill_worker_is_restarted_while_the_cluster_serves(up, expected_text):
    before = up.children()
    assert set(before) == {"redis", "router", "router-1", "prefill-0", "prefill-1", "decode-0"}
    old_address = registered(up)["prefill-0"]
    os.kill(before["prefill-0"], signal.SIGKILL)

    # Sent while prefill-0 is down (its registry entry may still name it): the decode worker
    # retries on prefill-1, or the router picks prefill-1 at once.
    status, body = up.complete()
    assert status == 200, body
    assert body["choices"][0]["text"] == expected_text

    wait_until(
        lambda: up.children().get("prefill-0", before["prefill-0"]) != before["prefill-0"],
        timeout_s=WAIT_S,
        interval_s=0.2,
        message="prefill-0 started again",
    )
    wait_until(
        lambda: registered(up).get("prefill-0") not in (None, old_address),
        timeout_s=WAIT_S,
        interval_s=0.2,
        message="the new prefill-0 registered",
    )
    after = up.children()
    assert {n: p for n, p in after.items() if n != "prefill-0"} == {
        n: p for n, p in before.items() if n != "prefill-0"
    }  # the others kept running
    output = up.output()
    assert f"prefill-0 (pid {before['prefill-0']}) exited with code -9 (SIGKILL)" in output
    assert f"prefill-0 restarted (pid {after['prefill-0']}, restart #1)" in output
    status, body = up.complete()
    assert status == 200, body
    assert body["choices"][0]["text"] == expected_text


def test_a_killed_redis_is_restarted_on_its_port_and_the_workers_register_again(up, expected_text):
    before = up.children()
    os.kill(before["redis"], signal.SIGKILL)
    # Served while Redis is down or just restarted, empty: the routers keep their snapshot.
    for router in (0, 1):
        status, body = up.complete(router)
        assert status == 200, body
        assert body["choices"][0]["text"] == expected_text
    wait_until(
        lambda: up.children().get("redis", before["redis"]) != before["redis"],
        timeout_s=WAIT_S,
        interval_s=0.2,
        message="redis started again",
    )
    wait_until(
        lambda: set(registered(up)) == {"prefill-0", "prefill-1", "decode-0"},
        timeout_s=WAIT_S,
        interval_s=0.2,
        message="every worker registered in the new Redis",
    )
    port = up.redis_url.rsplit(":", 1)[1].split("/")[0]
    assert f"redis restarted on port {port}" in up.output()
    assert {n: p for n, p in up.children().items() if n != "redis"} == {
        n: p for n, p in before.items() if n != "redis"
    }
    # The router follows the registry again: wait for it to see both pools, then serve.
    wait_until(
        lambda: _router_healthy(up),
        timeout_s=WAIT_S,
        interval_s=0.2,
        message="the router sees the workers",
    )
    status, body = up.complete()
    assert status == 200, body
    assert body["choices"][0]["text"] == expected_text


def test_a_killed_router_leaves_the_other_serving(up, expected_text):
    assert len(up.http_urls) == 2 and "router-1" in up.output().split("pdserve is up")[1]
    before = up.children()
    outcomes: list[tuple[int, dict]] = []
    killed = threading.Event()

    def steady_load() -> None:  # through the router that stays, before and after the kill
        while len(outcomes) < 3 or not killed.is_set() or len(outcomes) < 6:
            outcomes.append(up.complete(0))

    load = threading.Thread(target=steady_load)
    load.start()
    wait_until(lambda: len(outcomes) >= 2, timeout_s=WAIT_S, message="the load never started")
    os.kill(before["router-1"], signal.SIGKILL)
    killed.set()
    load.join(timeout=WAIT_S)
    assert [status for status, _ in outcomes] == [200] * len(outcomes)
    assert {body["choices"][0]["text"] for _, body in outcomes} == {expected_text}
    wait_until(
        lambda: up.children().get("router-1", before["router-1"]) != before["router-1"],
        timeout_s=WAIT_S,
        interval_s=0.2,
        message="router-1 started again",
    )
    assert f"router-1 (pid {before['router-1']}) exited with code -9 (SIGKILL)" in up.output()
    wait_until(lambda: _router_healthy(up, 1), timeout_s=WAIT_S, interval_s=0.2,
               message="the restarted router-1 serves")  # fmt: skip
    status, body = up.complete(1)
    assert status == 200, body
    assert body["choices"][0]["text"] == expected_text


def test_sigterm_to_the_launcher_stops_every_child(up):
    pids = up.children()
    assert len(pids) == 6
    up.process.send_signal(signal.SIGTERM)
    assert up.process.wait(timeout=120) == 0
    wait_until(
        lambda: up.output().rstrip().endswith("stopped."),
        timeout_s=60,
        interval_s=0.2,
        message="the last line",
    )
    assert "exited with" not in up.output().split("stopping the cluster...")[1]  # no restarts
    assert [name for name, pid in pids.items() if _is_alive(pid)] == []


def _router_healthy(up: Up, router: int = 0) -> bool:
    try:
        with urllib.request.urlopen(f"{up.http_urls[router]}/health", timeout=5) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError):
        return False


POLICY = RestartPolicy(backoff_s=1.0, max_backoff_s=30.0, stable_after_s=60.0)


@pytest.mark.parametrize(
    ("uptimes_s", "delays_s"),
    [
        ([5], [1]),  # the first death: the base delay
        ([5, 5, 5, 5, 5, 5, 5], [1, 2, 4, 8, 16, 30, 30]),  # a crash loop, capped
        ([5, 5, 5, 120], [1, 2, 4, 1]),  # a run that lasted resets the backoff
        ([120, 120], [1, 1]),
    ],
)
def test_restart_backoff_doubles_in_a_crash_loop_up_to_its_cap(uptimes_s, delays_s):
    restarts, now_s, delays = Restarts(started_s=0.0), 0.0, []
    for uptime_s in uptimes_s:
        now_s += uptime_s
        delays.append(restarts.schedule(POLICY, now_s))
        now_s = restarts.due_s
        restarts.restarted(now_s)
    assert delays == delays_s
    assert restarts.num_restarts == len(uptimes_s)


def test_up_refuses_decode_workers_without_a_prefill_worker_before_starting_anything():
    # It used to wait, silent, for a router that could never become healthy.
    command = [sys.executable, "-m", "pdserve.cli", "up", "--prefill", "0", "--decode", "1"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done
    assert done.stderr == (
        "pdserve up: decode workers need a prefill worker: add --prefill 1, or serve with "
        "--aggregated 1 --decode 0\n"
    )
    assert done.stdout == ""  # no banner, no progress: nothing was started


@pytest.mark.parametrize(
    ("shape", "message"),
    [
        ((-1, 1, 0), "--prefill -1: a worker count cannot be negative; use 0 or more"),
        ((1, -2, 0), "--decode -2: a worker count cannot be negative; use 0 or more"),
        ((1, 1, -1), "--aggregated -1: a worker count cannot be negative; use 0 or more"),
        ((0, 0, 0), "no workers: add --prefill 1 --decode 1, or --aggregated 1"),
        ((0, 2, 1), "decode workers need a prefill worker: add --prefill 1, or --decode 0 to "
                    "serve with the aggregated workers only"),
        ((1, 0, 0), "prefill workers need a decode worker: add --decode 1, or serve with "
                    "--aggregated 1 --prefill 0"),
        ((2, 0, 1), "prefill workers need a decode worker: add --decode 1, or --prefill 0 to "
                    "serve with the aggregated workers only"),
    ],
)  # fmt: skip
def test_shapes_that_cannot_serve_are_refused_with_the_fix(shape, message):
    with pytest.raises(ClusterShapeError) as refused:
        check_shape(*shape)
    assert str(refused.value) == message


@pytest.mark.parametrize("shape", [(1, 1, 0), (2, 1, 0), (0, 0, 1), (1, 1, 1), (0, 0, 3)])
def test_shapes_that_serve_pass(shape):
    check_shape(*shape)
