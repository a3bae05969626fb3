"""PNG plots of a simulated run: TTFT CDF per length bucket, per-worker utilisation over time,
the router's admission queue depth; and the planner's replicas and load over time."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only; no display on servers

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from pdserve.lengths import LENGTH_BUCKETS  # noqa: E402
from planner.planner import Planner  # noqa: E402
from sim.scenario import Result  # noqa: E402

NUM_WINDOWS = 40


def plot_all(result: Result, out_dir: Path) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    name = result.scenario.name
    paths = [
        _ttft_cdf(result, out_dir / f"{name}-ttft-cdf.png"),
        _utilisation(result, out_dir / f"{name}-utilisation.png"),
        _queue_depth(result, out_dir / f"{name}-queue-depth.png"),
    ]
    plt.close("all")
    return paths


def _ttft_cdf(result: Result, path: Path) -> Path:
    fig, ax = plt.subplots(figsize=(6, 4))
    for bucket in LENGTH_BUCKETS:
        ttfts = sorted(r.ttft_s for r in result.completed() if r.bucket == bucket and r.ttft_s)
        if ttfts:
            ax.plot(
                ttfts, np.arange(1, len(ttfts) + 1) / len(ttfts), label=f"{bucket} ({len(ttfts)})"
            )
    ax.set_xlabel("TTFT (s, simulated)")
    ax.set_ylabel("fraction of requests")
    ax.set_title(f"{result.scenario.name}: TTFT CDF by prompt length")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    return path


def _utilisation(result: Result, path: Path) -> Path:
    edges = np.linspace(0.0, result.end_s, NUM_WINDOWS + 1)
    fig, ax = plt.subplots(figsize=(7, 4))
    for worker_id, worker in result.workers.items():
        busy = [
            worker.timeline.busy_s(a, b) / (b - a) for a, b in zip(edges, edges[1:], strict=False)
        ]
        label = worker_id + (
            f" (x{worker.spec.speed_factor:g} slower)" if worker.spec.speed_factor != 1 else ""
        )
        ax.plot(edges[1:], busy, label=label, linewidth=1)
    ax.set_xlabel("time (s, simulated)")
    ax.set_ylabel("busy fraction")
    ax.set_ylim(0, 1.05)
    ax.set_title(f"{result.scenario.name}: per-worker utilisation")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    return path


def _queue_depth(result: Result, path: Path) -> Path:
    samples = result.samples.queue_depth
    fig, ax = plt.subplots(figsize=(7, 3.5))
    times = [t for t, _ in samples]
    for bucket in LENGTH_BUCKETS:
        ax.plot(times, [d[bucket] for _, d in samples], label=bucket, linewidth=1)
    ax.set_xlabel("time (s, simulated)")
    ax.set_ylabel("requests queued in the router")
    ax.set_title(f"{result.scenario.name}: admission queue depth")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    return path


def plot_planner(planners: dict[str, Planner], path: Path) -> Path:
    """One panel per predictor: desired vs actual replicas per pool (triangles: the backlog
    check's prefill scale-ups between decisions), and observed vs predicted request rate on the
    right axis."""
    fig, axes = plt.subplots(len(planners), 1, figsize=(8, 2.6 * len(planners)), sharex=True,
                             squeeze=False)  # fmt: skip
    for ax, (name, planner) in zip(axes[:, 0], planners.items(), strict=True):
        runs = planner.decisions
        minutes = [d.time_s / 60 for d in runs]
        for pool, colour in (("prefill", "tab:blue"), ("decode", "tab:orange")):
            ax.step(minutes, [d.actual[pool] for d in runs], where="post", color=colour,
                    label=f"{pool} actual")  # fmt: skip
            ax.step(minutes, [d.desired[pool] for d in runs], where="post", color=colour,
                    linestyle="--", label=f"{pool} desired")  # fmt: skip
        ups = planner.backlog_scale_ups
        ax.scatter([u.time_s / 60 for u in ups], [u.desired["prefill"] for u in ups],
                   marker="^", color="tab:blue", s=18, zorder=3,
                   label="prefill backlog scale-up")  # fmt: skip
        ax.set_ylabel("replicas")
        ax.set_title(f"{name}", fontsize=9)
        load = ax.twinx()
        load.plot(minutes, [d.observed["request_rate"] for d in runs], color="gray",
                  linewidth=0.8, label="req/s observed")  # fmt: skip
        load.plot(minutes, [d.predicted["request_rate"] for d in runs], color="black",
                  linewidth=0.8, linestyle=":", label="req/s predicted")  # fmt: skip
        load.set_ylabel("req/s")
        if ax is axes[0, 0]:
            ax.legend(fontsize=7, loc="upper left")
            load.legend(fontsize=7, loc="upper right")
    axes[-1, 0].set_xlabel("time (min, simulated)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
