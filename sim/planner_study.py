"""`pdserve sim planner`: the SLA planner (planner/) scaling the prefill and decode pools of a
16-GPU H200 cluster serving Llama-3-70B through a two-hour day (1x -> 8x -> 1x requests, with a
20-minute phase of long prompts), per predictor; against the smallest static prefill:decode
split that reaches the same SLO attainment, in GPU-hours."""

from __future__ import annotations

import math
import random
import sys
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry

from planner.metrics import PlannerMetrics
from planner.planner import Planner
from planner.profile import DecodeProfile, PrefillProfile, Profile
from planner.settings import PlannerSettings, PredictorName
from sim.costs import CostModel, StepShape
from sim.fleet import Fleet, FleetConfig, FleetRequest
from sim.goodput import TP, cost_model
from sim.scale import prefill_alone_s
from sim.workload import LengthMix

PREDICTORS: tuple[PredictorName, ...] = ("constant", "ewma", "holt")
GPU_BUDGET = 16
TTFT_TARGET_S, ITL_TARGET_S = 0.5, 0.05
TARGET_ATTAINMENT, TARGET_GPU_HOURS_RATIO = 0.95, 0.7
PROFILE_PROMPTS = (64, 128, 256, 512, 1024, 2048, 4096, 8192)
PROFILE_CONTEXTS = (256, 512, 1024, 2048, 4096, 8192)
PROFILE_BATCHES = (1, 2, 4, 8, 16, 32, 64, 128, 192, 256)


@dataclass(frozen=True, slots=True)
class Day:
    """rate(t) = base x (1 + (peak - 1) x sin^2(pi t / duration)): 1x at both ends, peak x at
    the middle; prompts from long_mix during [long_start_s, long_start_s + long_s)."""

    base_rate_per_s: float = 3.0
    peak: float = 8.0
    duration_s: float = 7200.0
    long_start_s: float = 4800.0  # on the way down from the peak: 6.25x -> 2.75x
    long_s: float = 1200.0
    mix: LengthMix = LengthMix("sharegpt")
    # Summarisation-like prompts (median ~2,000 tokens), capped where one prompt alone still
    # meets the 0.5 s TTFT target on an idle worker (3,072 tokens: ~0.48 s): longer ones miss
    # it whatever the planner does.
    long_mix: LengthMix = LengthMix("summarisation", max_prompt_tokens=3072)

    def lasting(self, hours: float) -> Day:
        """The same day compressed or stretched to this many hours (a short one for tests)."""
        scale = 3600 * hours / self.duration_s
        return replace(self, duration_s=self.duration_s * scale,
                       long_start_s=self.long_start_s * scale,
                       long_s=self.long_s * scale)  # fmt: skip

    def rate(self, t: float) -> float:
        return self.base_rate_per_s * (
            1 + (self.peak - 1) * math.sin(math.pi * t / self.duration_s) ** 2
        )

    def requests(self, seed: int) -> Iterator[FleetRequest]:
        """Poisson arrivals at rate(t), by thinning a process at the peak rate."""
        arrivals, lengths = random.Random(seed), random.Random(seed + 1)
        top = self.base_rate_per_s * self.peak
        t = 0.0
        while (t := t + arrivals.expovariate(top)) < self.duration_s:
            if arrivals.random() * top > self.rate(t):
                continue
            long = self.long_start_s <= t < self.long_start_s + self.long_s
            prompt, output = (self.long_mix if long else self.mix).draw(lengths)
            yield FleetRequest(t, prompt, output)


def profile_of(cost: CostModel, chunk_tokens: int) -> Profile:
    """What timing one worker would measure, from the cost model."""
    prefill_s = tuple(prefill_alone_s(cost, n, chunk_tokens) for n in PROFILE_PROMPTS)
    prefill = PrefillProfile(PROFILE_PROMPTS, prefill_s)
    itl = tuple(tuple(cost.step_s(StepShape(num_decode=b, decode_context=b * c, num_sampled=b))
                      for b in PROFILE_BATCHES) for c in PROFILE_CONTEXTS)  # fmt: skip
    return Profile(prefill, DecodeProfile(PROFILE_CONTEXTS, PROFILE_BATCHES, itl))


def settings(predictor: PredictorName) -> PlannerSettings:
    return PlannerSettings(
        ttft_target_s=TTFT_TARGET_S, itl_target_s=ITL_TARGET_S, interval_s=60.0,
        predictor=predictor, min_prefill=1, max_prefill=GPU_BUDGET // TP - 1, min_decode=1,
        max_decode=GPU_BUDGET // TP - 1, gpus_per_prefill=TP, gpus_per_decode=TP,
        gpu_budget=GPU_BUDGET,
    )  # fmt: skip


def simulate(fleet: Fleet, day: Day, seed: int, planner: Planner | None = None) -> None:
    """Runs the day, then ticks until every request has finished (with no decode pool: until
    every prompt has its first token)."""
    interval_s = planner.settings.interval_s if planner else math.inf
    check_s = planner.settings.backlog_check_s if planner else 0.0
    next_plan_s = interval_s
    next_check_s = check_s or math.inf
    arrivals = day.requests(seed)
    pending = next(arrivals, None)

    def busy() -> bool:
        if not fleet.decode:
            return bool(fleet.queue)
        return bool(fleet.queue or fleet.prefilled or any(w.running for w in fleet.decode))

    while pending is not None or busy():
        end_s = fleet.now_s + fleet.config.tick_s
        while pending is not None and pending.arrival_s < end_s:
            fleet.arrive(pending)
            pending = next(arrivals, None)
        fleet.tick()
        if planner is None:
            continue
        if fleet.now_s >= next_plan_s - 1e-9:
            planner.step(fleet.now_s)
            next_plan_s += interval_s
        elif fleet.now_s >= next_check_s - 1e-9:  # between decisions, as run_forever checks
            planner.check_backlog(fleet.now_s)
        if fleet.now_s >= next_check_s - 1e-9:
            next_check_s += check_s


def outcome(fleet: Fleet) -> dict[str, Any]:
    config = fleet.config
    met = sum(r.meets(config.ttft_target_s, config.itl_target_s) for r in fleet.requests)
    gpus = {"prefill": TP, "decode": TP}
    return {"requests": len(fleet.requests),
            "slo_attainment": round(met / len(fleet.requests), 4),
            "gpu_hours": round(fleet.gpu_seconds(gpus) / 3600, 2)}  # fmt: skip


def planned(predictor: PredictorName, cost: CostModel, profile: Profile, day: Day, seed: int,
            config: FleetConfig) -> tuple[Fleet, Planner]:  # fmt: skip
    """The planner's day, starting from one worker per pool."""
    fleet = Fleet(cost, config, prefill=1, decode=1)
    planner = Planner(settings(predictor), profile, source=fleet, connector=fleet,
                      metrics=PlannerMetrics(CollectorRegistry()))  # fmt: skip
    simulate(fleet, day, seed, planner)
    return fleet, planner


def static_splits(attainment: float, cost: CostModel, day: Day, seed: int,
                  config: FleetConfig, max_workers: int) -> list[dict[str, Any]]:  # fmt: skip
    """Static prefill:decode splits simulated in order of size (fewest workers, then fewest
    prefill ones), until one reaches the attainment or max_workers is passed. A split is
    simulated only if its prefill pool alone lets enough requests meet the TTFT target (a
    cheap run, and a bound: a request must meet both targets)."""
    # More prefill workers never lengthen a TTFT, so the fewest that pass the bound is enough.
    fewest_prefill = max_workers
    for prefill in range(1, max_workers):
        fleet = Fleet(cost, config, prefill=prefill, decode=0)
        simulate(fleet, day, seed)
        met = sum(r.ttft_s is not None and r.ttft_s <= config.ttft_target_s for r in fleet.requests)
        if met / len(fleet.requests) >= attainment:
            fewest_prefill = prefill
            break
    tried: list[dict[str, Any]] = []
    for total in range(2, max_workers + 1):
        for prefill in range(fewest_prefill, total):
            fleet = Fleet(cost, config, prefill=prefill, decode=total - prefill)
            simulate(fleet, day, seed)
            tried.append({"prefill": prefill, "decode": total - prefill, **outcome(fleet)})
            if tried[-1]["slo_attainment"] >= attainment:
                return tried
    return tried


def smallest_reaching(attainment: float, tried: list[dict[str, Any]]) -> dict[str, Any] | None:
    return next((row for row in tried if row["slo_attainment"] >= attainment), None)


def run(seed: int = 0, day: Day = Day(), plots_dir: Path | None = None,
        predictors: tuple[PredictorName, ...] = PREDICTORS) -> dict[str, Any]:  # fmt: skip
    cost = cost_model()
    config = FleetConfig(ttft_target_s=TTFT_TARGET_S, itl_target_s=ITL_TARGET_S)
    profile = profile_of(cost, config.chunk_tokens)
    max_workers = GPU_BUDGET // TP
    rows: dict[str, Any] = {}
    runs: dict[str, tuple[Fleet, Planner]] = {}
    for predictor in predictors:
        fleet, planner = planned(predictor, cost, profile, day, seed, config)
        runs[predictor] = (fleet, planner)
        rows[predictor] = outcome(fleet) | {
            "decisions": len(planner.decisions),
            "changes": sum(d.desired != d.actual for d in planner.decisions),
            "backlog_scale_ups": len(planner.backlog_scale_ups),
            "max_replicas": {
                pool: max(d.desired[pool] for d in planner.decisions)
                for pool in ("prefill", "decode")
            },  # fmt: skip
        }
    # Beyond the budget too: a static split may need more GPUs than the planner may use.
    highest = max(row["slo_attainment"] for row in rows.values())
    tried = static_splits(highest, cost, day, seed, config, 2 * max_workers)
    for row in rows.values():
        static = smallest_reaching(row["slo_attainment"], tried)
        row["best_static"] = static and f"{static['prefill']}P:{static['decode']}D"
        row["best_static_gpu_hours"] = static and static["gpu_hours"]
        row["gpu_hours_vs_best_static"] = static and round(
            row["gpu_hours"] / static["gpu_hours"], 3
        )
        row["meets_targets"] = bool(
            row["slo_attainment"] >= TARGET_ATTAINMENT and static
            and row["gpu_hours_vs_best_static"] <= TARGET_GPU_HOURS_RATIO
        )  # fmt: skip
    best = max(rows, key=lambda name: (rows[name]["slo_attainment"], -rows[name]["gpu_hours"]))
    if plots_dir is not None:
        try:  # matplotlib is a dev extra: the container image runs the study without plots
            from sim.plots import plot_planner
        except ImportError:
            print("(no PNG plots: matplotlib is not installed)", file=sys.stderr)
        else:
            plot_planner({name: planner for name, (_, planner) in runs.items()},
                         plots_dir / "planner-replicas.png")  # fmt: skip
    return {
        "slo_attainment": rows[best]["slo_attainment"],
        "gpu_hours_vs_best_static": rows[best]["gpu_hours_vs_best_static"],
        "best_predictor": best,
        "predictors": rows,
        "static_splits": tried,
        "config": {
            "model": "llama3-70b bf16",
            "gpu": cost.gpu.name,
            "tp": TP,
            "gpu_budget": GPU_BUDGET,
            "ttft_target_s": TTFT_TARGET_S,
            "itl_target_s": ITL_TARGET_S,
            "day": {
                "base_rate_per_s": day.base_rate_per_s,
                "peak": day.peak,
                "duration_s": day.duration_s,
                "long_start_s": day.long_start_s,
                "long_s": day.long_s,
            },
            "interval_s": settings("holt").interval_s,
            "backlog_check_s": settings("holt").backlog_check_s,
            "startup_s": config.startup_s,
            "tick_s": config.tick_s,
            "seed": seed,
        },  # fmt: skip
    }


def table(out: dict[str, Any]) -> str:
    lines = [f"{'predictor':<10}{'attainment':>11}{'GPU-hours':>10}{'max P':>6}{'max D':>6}"
             f"{'changes':>8}{'backlog':>8}{'best static':>12}{'its GPU-h':>10}"
             f"{'ratio':>7}"]  # fmt: skip
    for name, row in out["predictors"].items():
        static, ratio = row["best_static"], row["gpu_hours_vs_best_static"]
        lines.append(f"{name:<10}{row['slo_attainment']:>11.2%}{row['gpu_hours']:>10.1f}"
                     f"{row['max_replicas']['prefill']:>6}{row['max_replicas']['decode']:>6}"
                     f"{row['changes']:>8}{row['backlog_scale_ups']:>8}{static or 'none':>12}"
                     f"{row['best_static_gpu_hours'] or 0:>10.1f}"
                     f"{'-' if ratio is None else f'{ratio:.3f}':>7}")  # fmt: skip
    lines.append(
        "static splits simulated: "
        + ", ".join(
            f"{r['prefill']}P:{r['decode']}D {r['slo_attainment']:.2%}"
            for r in out["static_splits"]
        )
    )
    return "\n".join(lines)
