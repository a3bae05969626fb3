"""One scenario end to end: build the cluster on a fresh virtual-time loop, run the workload,
check that no KV block leaked, and summarise (JSON-ready numbers)."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pdserve.lengths import LENGTH_BUCKETS
from sim.clock import run_virtual
from sim.cluster import ClusterConfig, Record, Samples, SimRouter, Simulation
from sim.costs import CostModel
from sim.worker import CoreShare, SimWorker
from sim.workload import ClosedLoop, LengthMix, OpenLoop, RequestSource, Sequential

DRAIN_S = 1.0  # virtual seconds after the last request, for KV sends still in flight


@dataclass(frozen=True, slots=True)
class Scenario:
    name: str
    cluster: ClusterConfig
    mix: LengthMix
    load: OpenLoop | ClosedLoop
    seed: int = 0
    shared_prefix_tokens: int = 0


@dataclass(slots=True)
class Result:
    scenario: Scenario
    records: list[Record]
    workers: dict[str, SimWorker]
    routers: list[SimRouter]  # their state as the run left it (prefix index, ledgers)
    samples: Samples
    end_s: float
    router_cpu_s: float  # the router's code, collections left out (RouterMeter)
    router_gc_s: float  # collections that began inside router calls
    wall_s: float
    extra: dict[str, Any] = field(default_factory=dict)

    def completed(self) -> list[Record]:
        return [r for r in self.records if r.status == 200]

    def placement_pool(self) -> list[SimWorker]:
        """The workers placement spreads prompts over: prefill workers, or all aggregated."""
        return [w for w in self.workers.values() if w.spec.kind != "decode"]

    def utilisation(self) -> dict[str, float]:
        return {wid: w.timeline.busy_s(0.0, self.end_s) / self.end_s
                for wid, w in self.workers.items()}  # fmt: skip

    def kv_usage(self) -> dict[str, float]:
        return {wid: float(np.mean([u for t, u in w.timeline.kv_usage if t <= self.end_s]))
                for wid, w in self.workers.items()}  # fmt: skip

    def summary(self) -> dict[str, Any]:
        done = self.completed()
        duration = self.end_s
        util, kv = self.utilisation(), self.kv_usage()
        pool = [w.worker_id for w in self.placement_pool()]
        reasons: dict[str, int] = {}
        for r in self.records:
            if r.status == 429:
                reasons[r.reason] = reasons.get(r.reason, 0) + 1
        tokens = sum(r.num_prompt_tokens + r.num_output_tokens for r in done)
        return {
            "scenario": self.scenario.name,
            "requests": len(self.records),
            "completed": len(done),
            "rejected_429": sum(reasons.values()),
            "rejected_by_reason": reasons,
            "invalid_400": sum(r.status == 400 for r in self.records),
            "duration_s": round(duration, 3),
            "throughput_tokens_per_s": round(tokens / duration, 1),
            "output_tokens_per_s": round(sum(r.num_output_tokens for r in done) / duration, 1),
            "requests_per_s": round(len(done) / duration, 3),
            "ttft_s": _percentiles([r.ttft_s for r in done]),
            "ttft_by_bucket_s": {
                b: _percentiles([r.ttft_s for r in done if r.bucket == b]) for b in LENGTH_BUCKETS
            },  # fmt: skip
            "tpot_s": _percentiles([r.tpot_s for r in done]),
            "e2e_s": _percentiles([r.e2e_s for r in done]),
            "queue_wait_by_bucket_s": {
                b: _percentiles([r.queue_wait_s for r in done if r.bucket == b], with_max=True)
                for b in LENGTH_BUCKETS
            },
            "utilisation": {w: round(u, 4) for w, u in util.items()},
            "util_std_pp": round(100 * float(np.std([util[w] for w in pool])), 2),
            "kv_usage_mean": {w: round(u, 4) for w, u in kv.items()},
            "kv_std_pp": round(100 * float(np.std([kv[w] for w in kv])), 2),
            "num_preemptions": sum(r.num_preemptions for r in done),
            "requests_per_worker": _per_worker(done, pool),
            "router_cpu_us_per_request": round(
                1e6 * self.router_cpu_s / max(1, len(self.records)), 1
            ),
            "router_gc_us_per_request": round(
                1e6 * self.router_gc_s / max(1, len(self.records)), 1
            ),
            "sim_wall_s": round(self.wall_s, 2),
        } | self.extra


def _percentiles(
    values: list[float | None], with_max: bool = False
) -> dict[str, float | int | None]:
    data = [v for v in values if v is not None]
    if not data:
        return {"count": 0, "p50": None, "p90": None, "p99": None}
    p50, p90, p99 = np.percentile(data, [50, 90, 99]).tolist()
    out: dict[str, float | int | None] = {"count": len(data), "p50": round(p50, 4),
                                          "p90": round(p90, 4), "p99": round(p99, 4)}  # fmt: skip
    if with_max:
        out["max"] = round(max(data), 4)
    return out


def _per_worker(done: list[Record], pool: list[str]) -> dict[str, int]:
    counts = dict.fromkeys(pool, 0)
    for r in done:
        counts[r.prefill_worker] = counts.get(r.prefill_worker, 0) + 1
    return counts


def simulate(scenario: Scenario, cost: CostModel, cores: CoreShare | None = None,
             source: RequestSource | Sequential | None = None) -> Result:  # fmt: skip
    """source: the requests to send (default: drawn from the scenario's mix and seed)."""
    started = time.perf_counter()

    async def main() -> Result:
        sim = Simulation(scenario.cluster, cost, cores)
        sim.start()
        try:
            requests = source or RequestSource(
                scenario.mix, scenario.seed, scenario.shared_prefix_tokens
            )
            if isinstance(scenario.load, ClosedLoop):
                await sim.run_closed(scenario.load, requests)
            else:
                await sim.run_open(scenario.load, requests, scenario.seed)
            end_s = asyncio.get_running_loop().time()
            await asyncio.sleep(DRAIN_S)
        finally:
            await sim.stop()  # a failed run leaves no collector hook or frozen heap behind
        check_no_leaks(sim)
        meter = sim.meter
        return Result(scenario, sim.records, sim.workers, sim.routers, sim.samples, end_s,
                      meter.router_s, meter.gc_s, 0.0,
                      {"max_over_budget_tokens": sim.max_over_budget})  # fmt: skip

    result = run_virtual(main())
    result.wall_s = time.perf_counter() - started
    return result


def check_no_leaks(sim: Simulation) -> None:
    """The invariant every worker test checks: idle means every block is free again."""
    for worker in sim.workers.values():
        worker.engine.kv.check_integrity()
        pool = worker.engine.pool
        if worker.engine.has_unfinished_requests() or pool.num_free_blocks != pool.num_blocks:
            raise AssertionError(
                f"{worker.worker_id}: {pool.num_blocks - pool.num_free_blocks} KV blocks still "
                f"held, {len(worker.engine.requests)} requests left after the run"
            )
