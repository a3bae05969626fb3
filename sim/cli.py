"""`pdserve sim ...`: the simulator's studies; each prints a table, writes JSON and PNG plots
into --out, and prints one JSON line last."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Annotated, Any

import typer

app = typer.Typer(help="Cluster simulator: the real router and scheduler on a virtual clock.",
                  no_args_is_help=True)  # fmt: skip
Out = Annotated[str, typer.Option(help="Folder for JSON and plots; default: a new temp dir.")]
Seed = Annotated[int, typer.Option(help="Workload seed.")]


def _out_dir(out: str, name: str) -> Path:
    path = Path(out) if out else Path(tempfile.mkdtemp(prefix=f"pdserve-sim-{name}-"))
    path.mkdir(parents=True, exist_ok=True)
    return path


def _finish(out_dir: Path, name: str, table: str, result: dict[str, Any]) -> None:
    (out_dir / f"{name}.json").write_text(json.dumps(result, indent=1) + "\n")
    typer.echo(table)
    typer.echo(f"(JSON and plots in {out_dir})")
    typer.echo(json.dumps(result))


@app.command("seed-study")
def seed_study(
    requests: Annotated[int, typer.Option(help="Requests per step.")] = 1200,
    seed: Seed = 0,
    out: Out = "",
) -> None:
    """The published prefill-tuning steps on 8 simulated GPUs, one of them ~2x slower."""
    from sim import seed_study as study

    out_dir = _out_dir(out, "seed-study")
    result = study.run(requests, seed, out_dir)
    _finish(out_dir, "seed-study", study.table(result), result)


@app.command()
def goodput(
    gpus: Annotated[int, typer.Option(help="GPUs per cluster (two per worker).")] = 8,
    requests: Annotated[int, typer.Option(help="Requests per simulated rate.")] = 300,
    seed: Seed = 0,
    out: Out = "",
) -> None:
    """PD-disaggregated vs aggregated at equal GPU count: the highest rate meeting the SLOs."""
    from sim import goodput as study

    out_dir = _out_dir(out, "goodput")
    result = study.run(gpus, requests, seed)
    _finish(out_dir, "goodput", study.table(result), result)


@app.command()
def scale(
    sizes: Annotated[str, typer.Option(help="Worker counts, comma-separated.")] = "8,64,256,1024",
    seed: Seed = 0,
    out: Out = "",
) -> None:
    """8 -> 1,024 workers: the router's measured CPU per request, and admission fairness."""
    from sim import scale as study

    out_dir = _out_dir(out, "scale")
    result = study.run(tuple(int(n) for n in sizes.split(",")), seed)
    _finish(out_dir, "scale", study.table(result), result)


@app.command()
def validate(
    requests: Annotated[int, typer.Option(help="Requests per real run.")] = 200,
    shapes: Annotated[
        str, typer.Option(help="Clusters, comma-separated.")
    ] = "1P+1D,2P+1D,aggregated",
    workloads: Annotated[str, typer.Option(help="Workloads, comma-separated.")] = "prompt_mix,chat",
    seed: Seed = 0,
    out: Out = "",
) -> None:
    """Calibrate, then predict real `pdserve up` runs (3 shapes x 2 workloads) with the
    simulator; the worst errors over the runs last."""
    from sim import validate as study

    known = {shape.label: shape for shape in study.SHAPES}
    chosen = tuple(known[label] for label in _choice(shapes, known))
    loads = _choice(workloads, study.WORKLOADS)
    out_dir = _out_dir(out, "validate")
    result = study.run(requests, seed, out_dir, chosen, loads, report=_progress)
    _finish(out_dir, "validate", study.table(result), result)


def _choice(given: str, known) -> tuple[str, ...]:
    names = tuple(name.strip() for name in given.split(",") if name.strip())
    unknown = [name for name in names if name not in known]
    if unknown or not names:
        raise typer.BadParameter(
            f"{', '.join(unknown) or 'nothing'}: choose from {', '.join(known)}"
        )
    return names


def _progress(line: str) -> None:
    typer.echo(line, err=True)


@app.command()
def replicas(
    requests: Annotated[int, typer.Option(help="Closed-loop requests per run.")] = 2000,
    seeds: Annotated[str, typer.Option(help="Workload seeds, comma-separated.")] = "0,1,2,3",
    out: Out = "",
) -> None:
    """4 router replicas vs 1 on 64 workers: throughput, short TTFT p99 (means over the
    seeds), the budget bound."""
    from sim import replicas as study

    out_dir = _out_dir(out, "replicas")
    result = study.run(requests, tuple(int(s) for s in seeds.split(",")))
    _finish(out_dir, "replicas", study.table(result), result)


@app.command()
def planner(
    hours: Annotated[float, typer.Option(help="Length of the simulated day.")] = 2.0,
    seed: Seed = 0,
    out: Out = "",
) -> None:
    """The SLA planner through a day (1x -> 8x -> 1x, a phase of long prompts) on 16 H200s,
    per predictor, vs the smallest static prefill:decode split as good."""
    from sim import planner_study as study

    out_dir = _out_dir(out, "planner")
    result = study.run(seed, study.Day().lasting(hours), plots_dir=out_dir)
    _finish(out_dir, "planner", study.table(result), result)
