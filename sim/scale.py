"""`pdserve sim scale`: 8 -> 1,024 workers at the same load per worker. The router's own CPU cost
per request is measured (time.process_time around the real router calls, not modelled), and
admission fairness is checked: queue waits per length bucket against their aging delays, and
Jain's index over the requests' slowdowns."""

from __future__ import annotations

from typing import Any

import numpy as np

from engine import EngineConfig
from router.settings import AdmissionSettings, RoutingSettings
from sim.cluster import ClusterConfig
from sim.costs import CostModel, StepShape
from sim.scenario import Result, Scenario, simulate
from sim.seed_study import cost_model
from sim.worker import WorkerSpec
from sim.workload import LengthMix, OpenLoop

SIZES = (8, 64, 256, 1024)
RATE_PER_WORKER = 3.5  # req/s: where the router queue starts to hold requests (8 workers)
DURATION_S = 20.0


def cluster(num_workers: int, num_blocks: int) -> ClusterConfig:
    """Aggregated workers, one in eight ~2x slower, the router's default policies."""
    specs = tuple(WorkerSpec(f"gpu{i:02d}", "aggregated", 2.0 if i % 8 == 7 else 1.0)
                  for i in range(num_workers))  # fmt: skip
    engine = EngineConfig(num_blocks=num_blocks, max_num_seqs=128, chunk_size=1024)
    return ClusterConfig(specs, engine, engine, AdmissionSettings(),
                         RoutingSettings())  # fmt: skip


def fairness(result: Result, cost: CostModel, chunk: int) -> dict[str, Any]:
    """Slowdown = TTFT / the prompt's prefill alone on an idle fast worker."""
    done = result.completed()
    x = np.array([r.ttft_s / prefill_alone_s(cost, r.num_prompt_tokens, chunk) for r in done])
    delays = result.scenario.cluster.admission.delays_s()
    waits = {b: [r.queue_wait_s for r in done if r.bucket == b] for b in delays}
    return {
        "jain_index_slowdown": round(float(x.sum() ** 2 / (len(x) * (x**2).sum())), 4),
        "slowdown_p50": round(float(np.percentile(x, 50)), 2),
        "slowdown_p99": round(float(np.percentile(x, 99)), 2),
        "max_queue_wait_s": {b: round(max(w), 3) if w else None for b, w in waits.items()},
        "aging_delay_s": delays,
    }


def prefill_alone_s(cost: CostModel, num_tokens: int, chunk: int) -> float:
    seconds = 2 * cost.hop_s
    for start in range(0, num_tokens, chunk):
        n = min(chunk, num_tokens - start)
        shape = StepShape(num_prefill_tokens=n, num_attention_pairs=n * start + n * (n + 1) // 2,
                          prefill_context=start, num_prefill_segments=1,
                          num_sampled=int(start + n == num_tokens))  # fmt: skip
        seconds += cost.step_s(shape)
    return seconds


def run(sizes: tuple[int, ...] = SIZES, seed: int = 0) -> dict[str, Any]:
    cost = cost_model()
    num_blocks = cost.num_kv_blocks(16)
    rows: dict[str, Any] = {}
    for n in sizes:
        load = OpenLoop(rate_per_s=RATE_PER_WORKER * n, duration_s=DURATION_S)
        scenario = Scenario(f"scale-{n}", cluster(n, num_blocks), LengthMix("prefill_mix"), load,
                            seed)  # fmt: skip
        result = simulate(scenario, cost)
        s = result.summary()
        rows[str(n)] = {
            "requests": s["requests"], "completed": s["completed"],
            "rejected_429": s["rejected_429"],
            "router_cpu_us_per_request": s["router_cpu_us_per_request"],
            "router_gc_us_per_request": s["router_gc_us_per_request"],
            "ttft_p99_s": s["ttft_s"]["p99"], "util_std_pp": s["util_std_pp"],
            "sim_wall_s": s["sim_wall_s"],
            **fairness(result, cost, scenario.cluster.prefill_engine.chunk_size),
        }  # fmt: skip
    first, last = rows[str(sizes[0])], rows[str(sizes[-1])]
    return {
        "sizes": rows,
        "router_cpu_us_per_request": {k: v["router_cpu_us_per_request"] for k, v in rows.items()},
        "router_cpu_growth": round(
            last["router_cpu_us_per_request"] / first["router_cpu_us_per_request"], 2
        ),
        "router_gc_us_per_request": {k: v["router_gc_us_per_request"] for k, v in rows.items()},
        "jain_index": {k: v["jain_index_slowdown"] for k, v in rows.items()},
        "config": {
            "rate_per_worker": RATE_PER_WORKER,
            "duration_s": DURATION_S,
            "model": "llama3-70b 4-bit, H100",
            "mix": "prefill_mix",
        },  # fmt: skip
    }


def table(out: dict[str, Any]) -> str:
    lines = [f"{'workers':>8}{'requests':>10}{'429':>6}{'router CPU/req':>16}{'TTFT p99':>10}"
             f"{'Jain':>7}{'max wait s/m/l (s)':>22}"]  # fmt: skip
    for n, r in out["sizes"].items():
        w = r["max_queue_wait_s"]
        waits = "/".join(
            "-" if w[b] is None else f"{w[b]:.1f}" for b in ("short", "medium", "long")
        )
        lines.append(f"{n:>8}{r['requests']:>10}{r['rejected_429']:>6}"
                     f"{r['router_cpu_us_per_request']:>13.0f} us{r['ttft_p99_s']:>9.2f}s"
                     f"{r['jain_index_slowdown']:>7.3f}{waits:>22}")  # fmt: skip
    return "\n".join(lines)
