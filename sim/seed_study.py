"""`pdserve sim seed-study`: the published prefill-tuning steps on 8 simulated GPUs (one ~2x
slower), each step one change of our own settings, as ratios to our own baseline.

The study: a 70B dense model on 8 x 80 GB GPUs, 32 closed-loop clients, 70% short (64-256) /
30% long (1024-4096) prompts. Here: Llama-3-70B with 4-bit weights (bf16 ones do not fit one
80 GB card) on the H100 roofline, each GPU an aggregated worker (prefill and decode in one
engine, as in the study), the real router placing requests on them.
"""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

from engine import EngineConfig
from router.settings import AdmissionSettings, RoutingSettings
from sim.cluster import ClusterConfig
from sim.costs import H100, LLAMA3_70B, RooflineCost
from sim.scenario import Result, Scenario, simulate
from sim.worker import WorkerSpec
from sim.workload import ClosedLoop, LengthMix, OpenLoop

PUBLISHED = {
    "baseline": {"throughput_tok_s": 4800, "p99_s": 5.8, "util_std_pp": 19},
    "chunked": {"throughput_vs_baseline": 1.167, "p99_vs_baseline": 4.2 / 5.8, "util_std_pp": 13},
    "watermark": {"throughput_vs_baseline": 1.333, "p99_vs_baseline": 3.1 / 5.8, "util_std_pp": 8},
    "kv_reclaim": {
        "throughput_vs_baseline": 1.413,
        "p99_vs_baseline": 2.7 / 5.8,
        "kv_std_pp": [11, 5],
    },  # fmt: skip
}
PUBLISHED_PRIORITY = {"p99_fifo_s": 7.0, "p99_priority_s": 3.0}
STEPS = ("baseline", "chunked", "watermark", "kv_reclaim")
NUM_WORKERS, SLOW_WORKER_FACTOR, CONCURRENCY = 8, 2.0, 32
NO_CHUNK = 2048  # the engine's largest step budget: "no chunking" for prompts up to 2048


def cost_model() -> RooflineCost:
    return RooflineCost(LLAMA3_70B, H100, weight_bytes_per_param=0.5625)


def workers() -> tuple[WorkerSpec, ...]:
    return tuple(
        WorkerSpec(f"gpu{i}", "aggregated", SLOW_WORKER_FACTOR if i == NUM_WORKERS - 1 else 1.0)
        for i in range(NUM_WORKERS)
    )


def step_config(step: str, num_blocks: int) -> ClusterConfig:
    """Each step adds one change to the one before it."""
    index = STEPS.index(step)
    engine = EngineConfig(
        num_blocks=num_blocks, max_num_seqs=128,
        chunk_size=1024 if index >= 1 else NO_CHUNK,
        # Before the KV step: admit until the pool is full, and the router holds a request's
        # whole output up front; after: the 85% watermark, and 128 output tokens reserved.
        watermark=0.85 if index >= 3 else 1.0,
    )  # fmt: skip
    # Before the watermark step: hash placement and nothing held at the router, as a plain
    # Kubernetes Service gives; from it on, the router's prefill budget and FIFO queue too.
    admission = AdmissionSettings(
        mode="fifo" if index >= 2 else "pass_through",
        kv_output_reserve_tokens=128 if index >= 3 else 1 << 20,
    )
    routing = RoutingSettings(policy="watermark" if index >= 2 else "hash")
    return ClusterConfig(workers(), engine, engine, admission, routing)


def run(num_requests: int = 1200, seed: int = 0, plots_dir: Path | None = None) -> dict[str, Any]:
    cost = cost_model()
    num_blocks = cost.num_kv_blocks(16)
    mix = LengthMix("prefill_mix")
    results: dict[str, Result] = {}
    for step in STEPS:
        scenario = Scenario(f"seed-{step}", step_config(step, num_blocks), mix,
                            ClosedLoop(CONCURRENCY, num_requests), seed)  # fmt: skip
        results[step] = simulate(scenario, cost)
    ablation = priority_ablation(cost, num_blocks, seed, duration_s=max(20.0, num_requests / 10))
    if plots_dir is not None:
        try:  # matplotlib is a dev extra: the container image runs the study without plots
            from sim.plots import plot_all
        except ImportError:
            print("(no PNG plots: matplotlib is not installed)", file=sys.stderr)
        else:
            for result in [*results.values(), *ablation.values()]:
                plot_all(result, plots_dir)
    return report(results, ablation, cost, num_blocks)


def priority_ablation(
    cost: RooflineCost, num_blocks: int, seed: int, duration_s: float = 120.0
) -> dict[str, Result]:
    """The final step's cluster, Poisson at 8 req/s, plus bursts of 24 prompts of 4,096 tokens
    arriving together: FIFO admission vs short-before-long buckets (the router's defaults:
    short < 512, long > 2048, aging 5 s / 20 s)."""
    out = {}
    burst = LengthMix("fixed", prompt_tokens=4096, output_tokens=(32, 128))
    for mode in ("fifo", "length_aware"):
        config = step_config("kv_reclaim", num_blocks)
        config = replace(config, admission=replace(config.admission, mode=mode))
        bursts = tuple(t for t in (20.0, 50.0, 80.0) if t < duration_s) or (duration_s / 2,)
        load = OpenLoop(rate_per_s=8.0, duration_s=duration_s, bursts_s=bursts, burst_size=24,
                        burst_mix=burst)  # fmt: skip
        scenario = Scenario(f"seed-priority-{mode}", config, LengthMix("prefill_mix"), load, seed)
        out[mode] = simulate(scenario, cost)
    return out


def report(results: dict[str, Result], ablation: dict[str, Result], cost: RooflineCost,
           num_blocks: int) -> dict[str, Any]:  # fmt: skip
    summaries = {step: r.summary() for step, r in results.items()}
    base = summaries["baseline"]
    steps: dict[str, dict[str, Any]] = {}
    for step, s in summaries.items():
        row: dict[str, Any] = {
            "throughput_tok_s": s["throughput_tokens_per_s"],
            "p99_s": s["ttft_s"]["p99"],
            "util_std": s["util_std_pp"],
            "kv_std": s["kv_std_pp"],
            "preemptions": s["num_preemptions"],
            "rejected_429": s["rejected_429"],
        }
        if step != "baseline":
            row["throughput_vs_baseline"] = round(
                s["throughput_tokens_per_s"] / base["throughput_tokens_per_s"], 3
            )
            row["p99_vs_baseline"] = round(s["ttft_s"]["p99"] / base["ttft_s"]["p99"], 3)
        steps[step] = row
    fifo, prio = (ablation[m].summary() for m in ("fifo", "length_aware"))
    return {
        "steps": steps,
        "priority_ablation": {
            "p99_fifo_s": fifo["ttft_s"]["p99"],
            "p99_priority_s": prio["ttft_s"]["p99"],
            "short_p99_fifo_s": fifo["ttft_by_bucket_s"]["short"]["p99"],
            "short_p99_priority_s": prio["ttft_by_bucket_s"]["short"]["p99"],
            "long_p99_fifo_s": fifo["ttft_by_bucket_s"]["long"]["p99"],
            "long_p99_priority_s": prio["ttft_by_bucket_s"]["long"]["p99"],
        },
        "published": {"steps": PUBLISHED, "priority": PUBLISHED_PRIORITY},
        "config": {
            "model": "llama3-70b, 4-bit weights",
            "gpu": cost.gpu.name,
            "workers": NUM_WORKERS,
            "slow_worker_factor": SLOW_WORKER_FACTOR,
            "clients": CONCURRENCY,
            "requests_per_step": base["requests"],
            "baseline": "hash placement, pass_through admission (a plain Kubernetes Service)",
            "kv_blocks_per_worker": num_blocks,
            "p99": "TTFT, all requests",
            "throughput": "prompt + output tokens per second",
        },  # fmt: skip
    }


def table(out: dict[str, Any]) -> str:
    lines = [f"{'step':<11}{'ours tok/s':>11}{'ratio':>7}{'pub':>7}{'ours P99':>10}{'ratio':>7}"
             f"{'pub':>7}{'util std':>10}{'pub':>5}{'kv std':>8}"]  # fmt: skip
    for step, row in out["steps"].items():
        pub = PUBLISHED[step]
        r_tp = row.get("throughput_vs_baseline", 1.0)
        r_p99 = row.get("p99_vs_baseline", 1.0)
        lines.append(
            f"{step:<11}{row['throughput_tok_s']:>11.0f}{r_tp:>7.2f}"
            f"{pub.get('throughput_vs_baseline', 1.0):>7.2f}{row['p99_s']:>9.2f}s{r_p99:>7.2f}"
            f"{pub.get('p99_vs_baseline', 1.0):>7.2f}{row['util_std']:>9.1f}%"
            f"{pub.get('util_std_pp', 0):>4}%{row['kv_std']:>7.1f}%"
        )
    p = out["priority_ablation"]
    lines.append(
        f"priority ablation (bursts of long prompts): P99 FIFO {p['p99_fifo_s']:.2f} s, "
        f"short-first {p['p99_priority_s']:.2f} s (published 7 s -> under 3 s); "
        f"short P99 {p['short_p99_fifo_s']:.2f} -> {p['short_p99_priority_s']:.2f} s"
    )
    return "\n".join(lines)
