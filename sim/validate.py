"""`pdserve sim validate`: calibrate, then predict real `pdserve up` clusters with the simulator,
in one command and one window; reports throughput and TTFT p50/p99 errors as fractions of the
real value, per run and the worst case.

Calibration first (sim/calibrate.py at each thread count the clusters' workers get, pinned to
as many cores, and at one thread again beside a neighbour engine stepping on the other core:
workers on cores of their own still share memory bandwidth and caches), then every shape
(1P+1D, 2P+1D, one aggregated worker) under every workload:

- prompt_mix: bench/serve.py's workload at its default scale: the prefill-tuning mix with
  lengths x0.2 (13-51 / 205-819 tokens), 8 output tokens;
- chat: multi-turn conversations (sim/workload.py's Conversations) whose turns share their
  prefix with the turn before, so the prefix cache and the router's prefix index matter; each
  turn is sent after a pause of 0-1 s (the user reading and typing).

Each runs 4 closed-loop clients, the router's length buckets and prefill budget scaled like
the prompts. Workers are pinned to cores of their own where there are enough (1P+1D, the
aggregated worker); three workers on two cores share them (2P+1D), as the simulator's CoreShare
assumes. Workers start without warm-up; two unmeasured requests warm them (the simulator has no
first-run costs).
"""

from __future__ import annotations

import asyncio
import math
import os
import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import numpy as np

from engine import EngineConfig
from pdserve.lengths import LengthBuckets
from pdserve.registry import Role
from router.settings import AdmissionSettings, RoutingSettings
from sim.calibrate import calibrate, neighbour, summary
from sim.cluster import ClusterConfig, Record
from sim.costs import FITTED_QUANTIZATION, LocalCoefficients, LocalCost
from sim.scenario import Scenario, simulate
from sim.worker import CoreShare, WorkerSpec
from sim.workload import ClosedLoop, Conversations, LengthMix, RequestSource, Sequential

SCALE, MAX_TOKENS, CONCURRENCY = 0.2, 8, 4
SHORT_BELOW, LONG_ABOVE, PREFILL_TOKEN_BUDGET = 512, 2048, 2048  # the router's, before scaling
WORKLOADS = ("prompt_mix", "chat")
CHAT = Conversations()
TARGETS = {"throughput_error": 0.15, "ttft_p50_error": 0.15, "ttft_p99_error": 0.25}
# Before and after each measured run, the same cluster serves this many requests of the same
# workload, each time drawn with another seed: their steps, real against simulated, give each
# role's in-situ factor (in_situ_factors). Two windows, one on each side: a window's step cost
# varies from window to window on the same cluster (by up to 30% with 2P+1D's unpinned
# workers), and the host's speed may drift over the run; the two average the first and cancel
# the second.
CALIBRATION_REQUESTS, CALIBRATION_SEED_OFFSETS = 40, (1000, 2000)
# Before the first calibration run, the cluster idles this long: what its processes spend then
# is taken out of the calibration runs' CPU per request (host_cpu_s).
IDLE_S = 10.0
STEP_SUM = "pdserve_engine_step_seconds_sum"
# What a streamed token costs the host processes (the router and the client, each handling the
# token), as a share of what a request costs them apart from its tokens (parsing, placing,
# opening and closing its stream): on the Zen 4 host, 0.6 ms a token and 5.3 ms a request,
# from windows of 1 and of 33 output tokens (docs/measurements.md). validate's windows all
# stream the same number of tokens, so the total they measure is split by this share.
HOST_CPU_PER_TOKEN = 0.11


@dataclass(frozen=True, slots=True)
class Shape:
    label: str
    num_prefill: int
    num_decode: int
    num_aggregated: int = 0

    @property
    def num_workers(self) -> int:
        return self.num_prefill + self.num_decode + self.num_aggregated

    def threads_per_worker(self, num_cores: int) -> int:
        return self.spec(num_cores).threads_per_worker()

    def spec(self, num_cores: int, log_dir: Path | None = None):
        from pdserve.launcher import ClusterSpec

        return ClusterSpec(
            num_prefill=self.num_prefill, num_decode=self.num_decode,
            num_aggregated=self.num_aggregated, kv_backend="tcp", http_port=0, grpc_port=0,
            num_cores=num_cores, warmup=False, router_args=router_args(),
            worker_args=("--quantization", FITTED_QUANTIZATION), log_dir=log_dir,
        )  # fmt: skip


SHAPES = (Shape("1P+1D", 1, 1), Shape("2P+1D", 2, 1), Shape("aggregated", 0, 0, 1))


@dataclass(frozen=True, slots=True)
class Measured:
    throughput_tok_s: float
    ttft_p50_s: float
    ttft_p99_s: float
    num_completed: int
    wall_s: float


@dataclass(frozen=True, slots=True)
class HostCPU:
    """The router's, the client's and Redis's CPU (CoreShare): per request, before it is
    placed, and per token streamed."""

    per_request_s: float = 0.0
    per_token_s: float = 0.0

    @classmethod
    def split(cls, total_s: float, num_output_tokens: int) -> HostCPU:
        """A request's total (host_cpu_s) split by HOST_CPU_PER_TOKEN."""
        per_request_s = total_s / (1.0 + HOST_CPU_PER_TOKEN * num_output_tokens)
        return cls(per_request_s, HOST_CPU_PER_TOKEN * per_request_s)


def output_tokens(workload: str) -> int:
    """What each request of the workload streams."""
    return CHAT.output_tokens if workload == "chat" else MAX_TOKENS


def source(workload: str, num_requests: int, seed: int) -> Sequential:
    """The requests of a run, in the order its clients send them (a fresh copy each call)."""
    if workload == "chat":
        return Sequential(CHAT.draw(math.ceil(num_requests / CHAT.num_turns), seed))
    mix = LengthMix("prefill_mix", scale=SCALE, output_tokens=(MAX_TOKENS, MAX_TOKENS))
    requests = RequestSource(mix, seed)
    return Sequential.of([requests.next() for _ in range(num_requests)])


def admission() -> AdmissionSettings:
    return AdmissionSettings(
        buckets=LengthBuckets(round(SHORT_BELOW * SCALE), round(LONG_ABOVE * SCALE)),
        prefill_token_budget=round(PREFILL_TOKEN_BUDGET * SCALE),
    )


def router_args() -> tuple[str, ...]:
    a = admission()
    return (
        "--short-below", str(a.buckets.short_below), "--long-above", str(a.buckets.long_above),
        "--prefill-token-budget", str(a.prefill_token_budget), "--log-level", "warning",
    )  # fmt: skip


def summarize(ttfts: list[float], num_tokens: int, wall_s: float, num_completed: int) -> Measured:
    p50, p99 = np.percentile(ttfts, [50, 99]).tolist()
    return Measured(num_tokens / wall_s, p50, p99, num_completed, wall_s)


@contextmanager
def pinned(cores: list[int]):
    """This process on those cores only, for as long as the block runs."""
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cores)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


# ---- the simulator ------------------------------------------------------------------------


def predict(
    shape: Shape, requests: Sequential, num_requests: int, coefficients: LocalCoefficients,
    num_cores: int, beside: LocalCoefficients | None = None,
    in_situ: dict[Role, float] | None = None, host_cpu: HostCPU = HostCPU(),
) -> tuple[Measured, dict[str, float]]:  # fmt: skip
    """The simulated run's numbers, and each worker's seconds inside (modelled) steps.
    beside: the fit with a neighbour worker stepping (None: workers do not slow each other
    below the core count); in_situ: each role's step-time factor (in_situ_factors);
    host_cpu: the router's, client's and Redis's CPU, run beside the steps (CoreShare)."""
    cost = LocalCost(coefficients, num_cores=num_cores)
    neighbours = None if beside is None else LocalCost(beside, num_cores=num_cores)
    cores = CoreShare(num_cores, beside=neighbours, alone=cost,
                      threads_per_step=coefficients.threads,
                      host_cpu_s_per_request=host_cpu.per_request_s,
                      host_cpu_s_per_token=host_cpu.per_token_s)  # fmt: skip
    factors = in_situ or {}
    kinds: tuple[tuple[Role, int], ...] = (
        ("prefill", shape.num_prefill), ("decode", shape.num_decode),
        ("aggregated", shape.num_aggregated),
    )  # fmt: skip
    specs = tuple(WorkerSpec(f"{kind}-{i}", kind, factors.get(kind, 1.0))
                  for kind, count in kinds for i in range(count))  # fmt: skip
    config = ClusterConfig(specs, EngineConfig(), EngineConfig(), admission(),
                           RoutingSettings())  # fmt: skip
    scenario = Scenario(f"validate-{shape.label}", config, LengthMix(),
                        ClosedLoop(CONCURRENCY, num_requests))  # fmt: skip
    result = simulate(scenario, cost, cores, requests)
    steps = {wid: round(w.timeline.busy_s(0.0, result.end_s), 2)
             for wid, w in result.workers.items()}  # fmt: skip
    return _measured(result.completed(), result.end_s), steps


def _measured(done: list[Record], wall_s: float) -> Measured:
    tokens = sum(r.num_prompt_tokens + r.num_output_tokens for r in done)
    return summarize([r.ttft_s for r in done if r.ttft_s is not None], tokens, wall_s, len(done))


# ---- the real cluster ---------------------------------------------------------------------


def measure(shape: Shape, requests: Sequential, num_requests: int, cores: list[int],
            log_dir: Path, calibration: tuple[Sequential, Sequential],
            ) -> tuple[Measured, dict[str, Any]]:  # fmt: skip
    """The real run's numbers, where its CPU went (Usage), and each worker's step seconds
    in the calibration runs before and after it (CALIBRATION_REQUESTS of each of calibration,
    on the same cluster: in_situ_factors), summed."""
    from pdserve.launcher import LocalCluster

    cluster = LocalCluster(shape.spec(len(cores), log_dir / shape.label)).start()
    try:
        _pin_workers(cluster, shape, cores)
        assert cluster.router is not None
        url = cluster.router.http_url
        asyncio.run(_closed_loop(url, source("prompt_mix", 2, seed=-1), 2, 2))  # warm-up
        usage = Usage(cluster)
        idle = usage.read()
        time.sleep(IDLE_S)
        start = usage.read()
        _, first_s = asyncio.run(
            _closed_loop(url, calibration[0], CALIBRATION_REQUESTS, CONCURRENCY)
        )
        before = usage.read()
        outcomes, wall_s = asyncio.run(_closed_loop(url, requests, num_requests, CONCURRENCY))
        after = usage.read()
        _, second_s = asyncio.run(
            _closed_loop(url, calibration[1], CALIBRATION_REQUESTS, CONCURRENCY)
        )
        end = usage.read()
    finally:
        cluster.stop()
    ok = [(n, ttft, out) for n, ttft, out in outcomes if ttft is not None]
    tokens = sum(n + out for n, _, out in ok)
    spent: dict[str, Any] = {kind: _spent(before[kind], after[kind]) for kind in after}
    for kind in ("step_s", "cpu_s"):
        first, second = _spent(start[kind], before[kind]), _spent(after[kind], end[kind])
        spent[f"calibration_{kind}"] = {name: round(first.get(name, 0.0) + seconds, 2)
                                        for name, seconds in second.items()}  # fmt: skip
    spent["calibration_s"] = first_s + second_s
    spent["calibration_requests"] = len(calibration) * CALIBRATION_REQUESTS
    spent["idle_cpu_s"] = _spent(idle["cpu_s"], start["cpu_s"])
    return summarize([t for _, t, _ in ok], tokens, wall_s, len(ok)), spent


def _spent(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {name: round(after[name] - before.get(name, 0.0), 2) for name in after}


class Usage:
    """CPU seconds so far of every process of the run (the cluster's children, Redis, and this
    one, the load's client), and each worker's seconds inside engine steps (its step-time
    histogram's sum): what the simulator models is the steps; the rest shares the cores.

    The client's CPU leaves out what the readings themselves cost this process (~45 ms each:
    the workers' metrics scraped, the registry read): counted in, it was most of what the
    idle window measured, and the host CPU per request (host_cpu_s) came out 0 in some runs."""

    def __init__(self, cluster) -> None:
        self.cluster = cluster
        self._reading_s = 0.0  # this process's CPU inside read(), so far

    def read(self) -> dict[str, dict[str, float]]:
        import psutil

        from pdserve.registry import Registry
        from planner.local import scrape

        started_s = time.process_time()
        cluster = self.cluster
        pids = {child.name: child.process.pid for child in cluster.children}
        pids["redis"] = cluster.redis.process.pid
        cpu = {name: sum(psutil.Process(pid).cpu_times()[:2]) for name, pid in pids.items()}
        registry = Registry(cluster.redis_url)
        workers = [w for role in ("prefill", "decode", "aggregated")
                   for w in registry.workers(role)]  # fmt: skip
        steps = {w.worker_id: scrape(w.metrics_url, {STEP_SUM})[STEP_SUM] for w in workers}
        self._reading_s += time.process_time() - started_s
        cpu["client"] = time.process_time() - self._reading_s
        return {"cpu_s": cpu, "step_s": steps}


def _pin_workers(cluster, shape: Shape, cores: list[int]) -> None:
    """Each worker on cores of its own, its threads' worth, where there are enough; else all
    of them share every core (the simulator's CoreShare)."""
    threads = shape.threads_per_worker(len(cores))
    workers = [c for c in cluster.children if c.role != "router"]
    if len(workers) * threads > len(cores):
        return
    for i, child in enumerate(workers):
        os.sched_setaffinity(child.process.pid, cores[i * threads : (i + 1) * threads])


async def _closed_loop(url: str, requests: Sequential, num_requests: int, concurrency: int):
    import httpx

    remaining = [num_requests]
    outcomes: list[tuple[int, float | None, int]] = []

    async def client(index: int, http: httpx.AsyncClient) -> None:
        while remaining[0] > 0 and (item := requests.next(index)) is not None:
            remaining[0] -= 1
            if item.think_s:
                await asyncio.sleep(item.think_s)
            outcome = await _send(http, url, item)
            outcomes.append(outcome)
            if outcome[1] is None:  # refused: back off as the simulated client does
                await asyncio.sleep(1.0)

    started = time.monotonic()
    async with httpx.AsyncClient(timeout=300) as http:
        await asyncio.gather(*(client(i, http) for i in range(concurrency)))
    return outcomes, time.monotonic() - started


async def _send(http, url: str, item) -> tuple[int, float | None, int]:
    body = {"prompt": item.prompt_token_ids, "max_tokens": item.max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True}  # fmt: skip
    started = time.monotonic()
    ttft = None
    async with http.stream("POST", f"{url}/v1/completions", json=body) as response:
        if response.status_code != 200:
            await response.aread()
            return item.num_prompt_tokens, None, 0
        async for line in response.aiter_lines():
            if ttft is None and line.startswith("data: {") and '"text": ""' not in line:
                ttft = time.monotonic() - started
            if line == "data: [DONE]":
                break
    return item.num_prompt_tokens, ttft, item.max_tokens


# ---- the comparison -----------------------------------------------------------------------


def run(num_requests: int = 200, seed: int = 0, out_dir: Path | None = None,
        shapes: tuple[Shape, ...] = SHAPES, workloads: tuple[str, ...] = WORKLOADS,
        report: Callable[[str], None] = print) -> dict[str, Any]:  # fmt: skip
    log_dir = out_dir or Path("/tmp")
    cores = sorted(os.sched_getaffinity(0))
    fits: dict[int, LocalCoefficients] = {}
    for threads in sorted({shape.threads_per_worker(len(cores)) for shape in shapes}):
        report(f"calibrating the cost model at {threads} thread(s)...")
        with pinned(cores[:threads]):
            fits[threads] = calibrate(threads)
    # Workers side by side on cores of their own: the same steps timed beside a neighbour.
    beside: LocalCoefficients | None = None
    if any(s.num_workers > 1 for s in shapes) and 1 in fits and len(cores) > 1:
        report("calibrating the cost model at 1 thread beside a neighbour worker...")
        with pinned(cores[:1]), neighbour(cores[1:2], 1):
            beside = calibrate(1)
    runs: dict[str, Any] = {}
    for shape in shapes:
        coefficients = fits[shape.threads_per_worker(len(cores))]
        neighbours = beside if coefficients.threads == 1 else None
        for workload in workloads:
            label = f"{shape.label}/{workload}"
            report(f"{label}: {num_requests} requests on a real cluster...")
            first, second = (source(workload, CALIBRATION_REQUESTS, seed + offset)
                             for offset in CALIBRATION_SEED_OFFSETS)  # fmt: skip
            real, spent = measure(shape, source(workload, num_requests, seed), num_requests,
                                  cores, log_dir, (first, second))  # fmt: skip
            host_s = host_cpu_s(spent)
            host = HostCPU.split(host_s, output_tokens(workload))
            calibration_steps: dict[str, float] = {}
            for offset in CALIBRATION_SEED_OFFSETS:
                _, steps = predict(shape, source(workload, CALIBRATION_REQUESTS, seed + offset),
                                   CALIBRATION_REQUESTS, coefficients, len(cores), neighbours,
                                   host_cpu=host)  # fmt: skip
                for worker_id, seconds in steps.items():
                    calibration_steps[worker_id] = calibration_steps.get(worker_id, 0.0) + seconds
            in_situ = in_situ_factors(spent["calibration_step_s"], calibration_steps)
            sim, sim_steps = predict(shape, source(workload, num_requests, seed), num_requests,
                                     coefficients, len(cores), neighbours, in_situ,
                                     host)  # fmt: skip
            fitted, fitted_steps = predict(shape, source(workload, num_requests, seed),
                                           num_requests, coefficients, len(cores),
                                           neighbours)  # fmt: skip
            runs[label] = {"real": _round(real), "sim": _round(sim), **_errors(sim, real),
                           "real_cpu_s": spent["cpu_s"], "real_step_s": spent["step_s"],
                           "sim_step_s": sim_steps, "in_situ_factors": in_situ,
                           "real_calibration_step_s": spent["calibration_step_s"],
                           "host_cpu_ms_per_request": round(1e3 * host_s, 2),
                           "host_cpu_ms_split": {"per_request": round(1e3 * host.per_request_s, 2),
                                                 "per_token": round(1e3 * host.per_token_s, 3)},
                           "sim_without_in_situ": _round(fitted),
                           "sim_step_s_without_in_situ": fitted_steps,
                           "errors_without_in_situ": _errors(fitted, real)}  # fmt: skip
    worst = {k: max(r[k] for r in runs.values()) for k in TARGETS}
    return {
        "runs": runs,
        "worst_run": {k: max(runs, key=lambda label: runs[label][k]) for k in TARGETS},
        "calibration": {str(t): summary(fit) for t, fit in fits.items()}
        | ({"1_beside_a_neighbour": summary(beside)} if beside is not None else {}),
        "cores": cores,
        "requests_per_run": num_requests,
        "targets": TARGETS,
        **worst,
    }


def host_cpu_s(spent: dict[str, Any]) -> float:
    """CPU seconds per request of the processes that are not workers (the router, the load's
    client, Redis) over the calibration runs, less what they spend idle in as long (measured
    over IDLE_S before the first): the work that comes with each request, run beside the steps
    (CoreShare). What they spend idle (heartbeats, registry reads, metrics; ~15 ms a second)
    runs at any time, and stays in the in-situ factor with the workers' own threads beside
    their steps (RPC, KV transfer)."""
    workers = spent["calibration_step_s"]

    def others(cpu_s: dict[str, float]) -> float:
        return sum(seconds for name, seconds in cpu_s.items() if name not in workers)

    idle_per_s = others(spent["idle_cpu_s"]) / IDLE_S
    busy = others(spent["calibration_cpu_s"]) - idle_per_s * spent["calibration_s"]
    return max(0.0, busy) / spent["calibration_requests"]


def in_situ_factors(
    real_step_s: dict[str, float], sim_step_s: dict[str, float]
) -> dict[Role, float]:
    """Each role's step-time factor: its workers' real step seconds over the simulator's on the
    calibration runs, summed over the role (its workers are alike; one worker's share of 40
    requests is not), the simulator's runs with the host processes' CPU (host_cpu_s) beside
    its steps. It is what a step costs inside the running cluster beyond the isolated fit and
    that CPU: the workers' own RPC and KV threads, caches, and the fit's error on the run's
    shapes. Worker ids are "<role>-<i>", in the simulation as the launcher names them."""
    real: dict[Role, float] = {}
    simulated: dict[Role, float] = {}
    for worker_id, seconds in sim_step_s.items():
        role = cast(Role, worker_id.rsplit("-", 1)[0])
        real[role] = real.get(role, 0.0) + real_step_s.get(worker_id, 0.0)
        simulated[role] = simulated.get(role, 0.0) + seconds
    return {
        role: round(real[role] / seconds, 3) for role, seconds in simulated.items() if seconds > 0
    }


def _errors(sim: Measured, real: Measured) -> dict[str, float]:
    return {
        "throughput_error": _error(sim.throughput_tok_s, real.throughput_tok_s),
        "ttft_p50_error": _error(sim.ttft_p50_s, real.ttft_p50_s),
        "ttft_p99_error": _error(sim.ttft_p99_s, real.ttft_p99_s),
    }


def _error(predicted: float, real: float) -> float:
    return round(abs(predicted - real) / real, 3)


def _round(m: Measured) -> dict[str, float]:
    return {"throughput_tok_s": round(m.throughput_tok_s, 1), "ttft_p50_s": round(m.ttft_p50_s, 3),
            "ttft_p99_s": round(m.ttft_p99_s, 3), "completed": m.num_completed,
            "wall_s": round(m.wall_s, 2)}  # fmt: skip


def table(out: dict[str, Any]) -> str:
    lines = [f"{'run':<22}{'':>6}{'tok/s':>9}{'TTFT p50':>10}{'TTFT p99':>10}"]
    for label, r in out["runs"].items():
        for kind in ("real", "sim"):
            m = r[kind]
            lines.append(f"{label:<22}{kind:>6}{m['throughput_tok_s']:>9.1f}"
                         f"{m['ttft_p50_s']:>9.2f}s{m['ttft_p99_s']:>9.2f}s")  # fmt: skip
        lines.append(f"{'':<22}{'error':>6}{r['throughput_error']:>9.0%}"
                     f"{r['ttft_p50_error']:>10.0%}{r['ttft_p99_error']:>10.0%}")  # fmt: skip
        e = r["errors_without_in_situ"]
        lines.append(f"{'  (fit alone)':<22}{'error':>6}{e['throughput_error']:>9.0%}"
                     f"{e['ttft_p50_error']:>10.0%}{e['ttft_p99_error']:>10.0%}")  # fmt: skip
    lines.append(f"{'worst':<22}{'':>6}{out['throughput_error']:>9.0%}"
                 f"{out['ttft_p50_error']:>10.0%}{out['ttft_p99_error']:>10.0%}")  # fmt: skip
    return "\n".join(lines)
