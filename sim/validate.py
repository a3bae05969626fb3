"""`pdserve sim validate`: the simulator with the fitted local cost model predicts real
`pdserve up` clusters (1 prefill + 1 decode, then 2 + 1) on this machine, same workload, same
router settings; reports throughput and TTFT p50/p99 errors as fractions of the real value.

The workload is bench/serve.py's at its default scale: the prefill-tuning mix with lengths x0.2
(13-51 / 205-819 tokens), 8 output tokens, 4 closed-loop clients, the router's length buckets
and prefill budget scaled alike. Workers start without warm-up; two unmeasured requests warm
them (the simulator has no first-run costs).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from engine import EngineConfig
from pdserve.lengths import LengthBuckets
from router.settings import AdmissionSettings, RoutingSettings
from sim.cluster import ClusterConfig, Record
from sim.costs import FITTED_QUANTIZATION, LocalCoefficients, LocalCost
from sim.scenario import Scenario, simulate
from sim.worker import CoreShare, WorkerSpec
from sim.workload import ClosedLoop, LengthMix, RequestSource, SimRequest

SCALE, MAX_TOKENS, CONCURRENCY = 0.2, 8, 4
SHORT_BELOW, LONG_ABOVE, PREFILL_TOKEN_BUDGET = 512, 2048, 2048  # the router's, before scaling
CLUSTERS = ((1, 1), (2, 1))  # (prefill, decode)


@dataclass(frozen=True, slots=True)
class Measured:
    throughput_tok_s: float
    ttft_p50_s: float
    ttft_p99_s: float
    num_completed: int
    wall_s: float


def requests(num: int, seed: int) -> list[SimRequest]:
    mix = LengthMix("prefill_mix", scale=SCALE, output_tokens=(MAX_TOKENS, MAX_TOKENS))
    source = RequestSource(mix, seed)
    return [source.next() for _ in range(num)]


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


# ---- the simulator ------------------------------------------------------------------------


class _ListSource:
    """The same requests, in the same order, as the real run sends."""

    def __init__(self, items: list[SimRequest]) -> None:
        self._items = list(items)

    def next(self, client: int = 0) -> SimRequest:
        return self._items.pop(0)


def predict(num_prefill: int, num_decode: int, items: list[SimRequest],
            speed_factor: float = 1.0) -> Measured:  # fmt: skip
    cost = LocalCost(LocalCoefficients.load())
    specs = tuple(
        WorkerSpec(f"prefill-{i}", "prefill", speed_factor) for i in range(num_prefill)
    ) + tuple(WorkerSpec(f"decode-{i}", "decode", speed_factor) for i in range(num_decode))
    config = ClusterConfig(specs, EngineConfig(), EngineConfig(), admission(),
                           RoutingSettings())  # fmt: skip
    scenario = Scenario(f"validate-{num_prefill}p{num_decode}d", config, LengthMix(),
                        ClosedLoop(CONCURRENCY, len(items)))  # fmt: skip
    result = simulate(scenario, cost, CoreShare(cost.num_cores), _ListSource(items))  # type: ignore[arg-type]
    done = result.completed()
    return _measured(done, result.end_s)


def _measured(done: list[Record], wall_s: float) -> Measured:
    tokens = sum(r.num_prompt_tokens + r.num_output_tokens for r in done)
    return summarize([r.ttft_s for r in done if r.ttft_s is not None], tokens, wall_s, len(done))


def probe_slowdown() -> float:
    """How much slower the machine runs the real engine right now than when local_cpu.json was
    fitted (other processes share these cores): measured / predicted seconds over a few steps
    of one prefill and one decode batch, one thread."""
    from engine import LLMEngine, SamplingParams
    from sim.costs import StepShape

    cost = LocalCost(LocalCoefficients.load())
    engine = LLMEngine(EngineConfig(num_threads=1, num_blocks=256, enable_prefix_caching=False,
                                    quantization=FITTED_QUANTIZATION))  # fmt: skip
    execute, shapes = engine.runner.execute, []
    engine.runner.execute = lambda batch: (shapes.append(StepShape.of(batch)), execute(batch))[1]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    measured = predicted = 0.0
    for round_index in range(2):  # the first pays first-run costs
        for i, n in enumerate((256, 32, 32, 32, 32)):
            engine.add_request(f"probe-{round_index}-{i}", list(range(1000, 1000 + n)), params)
        while engine.has_unfinished_requests():
            started = time.perf_counter()
            engine.step()
            if round_index:
                measured += time.perf_counter() - started
                predicted += cost.step_s(shapes[-1])
    return measured / predicted


# ---- the real cluster ---------------------------------------------------------------------


def measure(num_prefill: int, num_decode: int, items: list[SimRequest], log_dir: Path) -> Measured:
    from pdserve.launcher import ClusterSpec, LocalCluster

    spec = ClusterSpec(num_prefill=num_prefill, num_decode=num_decode, kv_backend="tcp",
                       http_port=0, grpc_port=0, warmup=False, router_args=router_args(),
                       worker_args=("--quantization", FITTED_QUANTIZATION),
                       log_dir=log_dir / f"{num_prefill}p{num_decode}d")  # fmt: skip
    cluster = LocalCluster(spec).start()
    try:
        assert cluster.router is not None
        url = cluster.router.http_url
        warm = requests(2, seed=-1)
        asyncio.run(_closed_loop(url, warm, 2))
        outcomes, wall_s = asyncio.run(_closed_loop(url, items, CONCURRENCY))
    finally:
        cluster.stop()
    ok = [(n, ttft, out) for n, ttft, out in outcomes if ttft is not None]
    tokens = sum(n + out for n, _, out in ok)
    return summarize([t for _, t, _ in ok], tokens, wall_s, len(ok))


async def _closed_loop(url: str, items: list[SimRequest], concurrency: int):
    import httpx

    pending = iter(items)
    outcomes: list[tuple[int, float | None, int]] = []

    async def client(http: httpx.AsyncClient) -> None:
        for item in pending:
            outcomes.append(await _send(http, url, item))

    started = time.monotonic()
    async with httpx.AsyncClient(timeout=300) as http:
        await asyncio.gather(*(client(http) for _ in range(concurrency)))
    return outcomes, time.monotonic() - started


async def _send(http, url: str, item: SimRequest) -> tuple[int, float | None, int]:
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


def run(num_requests: int = 24, seed: int = 0, out_dir: Path | None = None) -> dict[str, Any]:
    log_dir = out_dir or Path("/tmp")
    items = requests(num_requests, seed)
    runs: dict[str, Any] = {}
    for num_prefill, num_decode in CLUSTERS:
        label = f"{num_prefill}P+{num_decode}D"
        slowdown = probe_slowdown()
        real = measure(num_prefill, num_decode, items, log_dir)
        sim = predict(num_prefill, num_decode, items)
        probed = predict(num_prefill, num_decode, items, slowdown)
        runs[label] = {"real": _round(real), "sim": _round(sim), **_errors(sim, real),
                       "probe_slowdown": round(slowdown, 3), "sim_probed": _round(probed),
                       "probed_errors": _errors(probed, real)}  # fmt: skip
    keys = ("throughput_error", "ttft_p50_error", "ttft_p99_error")
    worst = {k: max(r[k] for r in runs.values()) for k in keys}
    worst_probed = {k: max(r["probed_errors"][k] for r in runs.values()) for k in keys}
    # The top-level errors are the committed fit's (worst over the runs); the probed ones rescale
    # every step by how loaded the machine was just before each real run, as context.
    return {
        "runs": runs,
        "with_speed_probe": worst_probed,
        "targets": {"throughput_error": 0.25, "ttft_p50_error": 0.25, "ttft_p99_error": 0.40},
        **worst,
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
    lines = [f"{'cluster':<8}{'':>6}{'tok/s':>9}{'TTFT p50':>10}{'TTFT p99':>10}"]
    for label, r in out["runs"].items():
        for kind in ("real", "sim"):
            m = r[kind]
            lines.append(f"{label:<8}{kind:>6}{m['throughput_tok_s']:>9.1f}"
                         f"{m['ttft_p50_s']:>9.2f}s{m['ttft_p99_s']:>9.2f}s")  # fmt: skip
        lines.append(f"{'':<8}{'error':>6}{r['throughput_error']:>9.0%}{r['ttft_p50_error']:>10.0%}"
                     f"{r['ttft_p99_error']:>10.0%}")  # fmt: skip
        m, e = r["sim_probed"], r["probed_errors"]
        lines.append(f"{'':<8}{'probed':>6}{m['throughput_tok_s']:>9.1f}{m['ttft_p50_s']:>9.2f}s"
                     f"{m['ttft_p99_s']:>9.2f}s   (machine {r['probe_slowdown']:.2f}x slower "
                     f"than at calibration; errors {e['throughput_error']:.0%} / "
                     f"{e['ttft_p50_error']:.0%} / {e['ttft_p99_error']:.0%})")  # fmt: skip
    return "\n".join(lines)
