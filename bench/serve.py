"""Router load test: length-aware admission vs FIFO on the same local cluster and workload.

The workload is the published prefill-tuning mix: 70% short prompts, 30% long ones, sent by a
fixed number of concurrent clients (closed loop) as streaming completions over the router's
OpenAI HTTP API, on loopback. The published lengths (64-256 and 1024-4096 tokens) take minutes
per batch on 2 CPU cores (fp32 prefill runs ~150 tokens/s on one thread), so lengths are scaled
by --scale (default 0.2: 13-51 and 205-819 tokens), and the router's length buckets (512 / 2048)
and prefill token budget (2048) with them.
Prompts are random words (different text per mode, the same lengths), so no prefix cache helps.
Each mode runs at most --requests requests and --max-seconds seconds.

Prints a table, then one JSON line (the last line of stdout) whose key short_ttft_p99_ratio is
length-aware / FIFO short-request TTFT p99 (below 1: length-aware admission cuts the tail).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# bench/engine.py would shadow the engine package: import from the repository root instead.
_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]
sys.path.insert(0, str(_HERE.parent))

import httpx  # noqa: E402

from engine.model_files import resolve_model  # noqa: E402
from engine.tokenizer import TextTokenizer  # noqa: E402
from pdserve.launcher import ClusterSpec, LocalCluster, RouterEndpoint  # noqa: E402

MODES = ("length_aware", "fifo")
SHORT_TOKENS, LONG_TOKENS, LONG_FRACTION = (64, 256), (1024, 4096), 0.3
SHORT_BELOW, LONG_ABOVE, PREFILL_TOKEN_BUDGET = 512, 2048, 2048  # the router's defaults


@dataclass(frozen=True, slots=True)
class Job:
    kind: str  # "short" | "long"
    prompt_token_ids: list[int]


@dataclass(frozen=True, slots=True)
class Outcome:
    kind: str
    status: int
    ttft_s: float | None = None
    e2e_s: float | None = None
    num_prompt_tokens: int = 0


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scale", type=float, default=0.2, help="prompt length scale")
    parser.add_argument("--requests", type=int, default=40, help="per mode")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--max-seconds", type=float, default=60.0, help="per mode")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--cores", type=int, default=0, help="0 = all")
    parser.add_argument("--long-delay-s", type=float, help="aging; default: the router's")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args()


def word_ids(tokenizer: TextTokenizer) -> list[int]:
    """Token ids that are one plain word with a leading space: prompts read like text."""
    pieces = tokenizer.hf.get_vocab().items()
    # Byte-level BPE spells a leading space as "Ġ".
    return sorted(i for p, i in pieces if p[:1] == "Ġ" and p[1:].isalpha() and p[1:].isascii())


def workload(args: argparse.Namespace, words: list[int], mode_index: int) -> list[Job]:
    """The same kinds and lengths for every mode; the words differ (no cross-mode cache hits)."""
    shape, text = random.Random(args.seed), random.Random(args.seed * 1000 + mode_index + 1)
    jobs = []
    for _ in range(args.requests):
        kind = "long" if shape.random() < LONG_FRACTION else "short"
        low, high = LONG_TOKENS if kind == "long" else SHORT_TOKENS
        length = round(shape.randint(low, high) * args.scale)
        jobs.append(Job(kind, [text.choice(words) for _ in range(length)]))
    return jobs


def warm_up(args: argparse.Namespace, words: list[int]) -> list[Job]:
    """One short and one long prompt: first-run costs are paid before measuring."""
    lengths = {"short": SHORT_TOKENS[0], "long": LONG_TOKENS[0]}
    text = random.Random(-1)
    return [Job(kind, [text.choice(words) for _ in range(round(n * args.scale))])
            for kind, n in lengths.items()]  # fmt: skip


async def send(client: httpx.AsyncClient, url: str, job: Job, max_tokens: int) -> Outcome:
    body = {"prompt": job.prompt_token_ids, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True}  # fmt: skip
    started = time.monotonic()
    ttft_s = None
    async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
        if response.status_code != 200:
            await response.aread()
            return Outcome(job.kind, response.status_code)
        async for line in response.aiter_lines():
            if ttft_s is None and line.startswith("data: {") and '"text": ""' not in line:
                ttft_s = time.monotonic() - started
            if line == "data: [DONE]":
                break
    return Outcome(job.kind, 200, ttft_s, time.monotonic() - started, len(job.prompt_token_ids))


async def run_load(url: str, jobs: list[Job], args: argparse.Namespace) -> tuple[list, float]:
    pending = iter(jobs)
    outcomes: list[Outcome] = []
    started = time.monotonic()
    deadline = started + args.max_seconds

    async def closed_loop_client(client: httpx.AsyncClient) -> None:
        for job in pending:  # one shared iterator: each job is sent once
            if time.monotonic() > deadline:
                return
            outcomes.append(await send(client, url, job, args.max_tokens))

    limits = httpx.Limits(max_connections=args.concurrency + 2)
    async with httpx.AsyncClient(timeout=300, limits=limits) as client:
        await asyncio.gather(*(closed_loop_client(client) for _ in range(args.concurrency)))
    return outcomes, time.monotonic() - started


def percentile(values: list[float], q: int) -> float | None:
    if not values:
        return None
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1]


def summarize(outcomes: list[Outcome], wall_s: float, queue_wait: dict) -> dict[str, Any]:
    done = [o for o in outcomes if o.status == 200]
    summary: dict[str, Any] = {
        "requests": len(outcomes),
        "completed": len(done),
        "rejected_429_rate": sum(o.status == 429 for o in outcomes) / max(1, len(outcomes)),
        "errors": sum(o.status not in (200, 429) for o in outcomes),
        "wall_s": round(wall_s, 2),
        "throughput_req_per_s": round(len(done) / wall_s, 3),
        "prompt_tokens_per_s": round(sum(o.num_prompt_tokens for o in done) / wall_s, 1),
    }
    for kind in ("short", "long"):
        ttfts = [o.ttft_s for o in done if o.kind == kind and o.ttft_s is not None]
        summary[kind] = {
            "count": len(ttfts),
            "ttft_p50_s": _round(percentile(ttfts, 50)),
            "ttft_p99_s": _round(percentile(ttfts, 99)),
            "router_queue_wait_mean_s": _round(queue_wait.get(kind)),
        }
    return summary


def router_queue_wait(router: RouterEndpoint) -> dict[str, float]:
    """Mean time in the router's admission queue per length bucket, from its /metrics."""
    sums: dict[str, dict[str, float]] = {}
    for line in httpx.get(f"{router.http_url}/metrics", timeout=10).text.splitlines():
        if line.startswith("pdserve_router_queue_wait_seconds_"):
            name, value = line.rsplit(" ", 1)
            stat = name.split("{")[0].rsplit("_", 1)[-1]
            bucket = name.split('length_bucket="')[1].split('"')[0]
            sums.setdefault(bucket, {})[stat] = float(value)
    return {b: s["sum"] / s["count"] for b, s in sums.items() if s.get("count")}


def router_args(mode: str, args: argparse.Namespace) -> tuple[str, ...]:
    scale = args.scale
    aging = () if args.long_delay_s is None else ("--long-delay-s", str(args.long_delay_s))
    return (
        *aging, "--admission", mode, "--short-below", str(round(SHORT_BELOW * scale)),
        "--long-above", str(round(LONG_ABOVE * scale)),
        "--prefill-token-budget", str(round(PREFILL_TOKEN_BUDGET * scale)),
        "--log-level", "warning",
    )  # fmt: skip


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 4)


def main() -> None:
    args = parse_args()
    started = time.monotonic()
    tokenizer = TextTokenizer.load(resolve_model("smollm2-135m"))
    words = word_ids(tokenizer)
    spec = ClusterSpec(dtype=args.dtype, kv_backend="tcp", num_cores=args.cores, warmup=False,
                       with_router=False)  # fmt: skip
    cluster = LocalCluster(spec).start()
    results: dict[str, Any] = {}
    try:
        for index, mode in enumerate(MODES):
            router = cluster.add_router(f"router-{mode}", router_args(mode, args))
            asyncio.run(run_load(router.http_url, warm_up(args, words), args))  # not measured
            outcomes, wall_s = asyncio.run(
                run_load(router.http_url, workload(args, words, index), args)
            )
            results[mode] = summarize(outcomes, wall_s, router_queue_wait(router))
            cluster.remove_router(router)
    finally:
        cluster.stop()
    print_table(results)
    aware, fifo = results["length_aware"]["short"], results["fifo"]["short"]
    ratio = None
    if aware["ttft_p99_s"] and fifo["ttft_p99_s"]:
        ratio = round(aware["ttft_p99_s"] / fifo["ttft_p99_s"], 3)
    print(f"({time.monotonic() - started:.0f} s; cluster logs in {cluster.log_dir})")
    config = vars(args) | {
        "short_tokens": [round(n * args.scale) for n in SHORT_TOKENS],
        "long_tokens": [round(n * args.scale) for n in LONG_TOKENS],
        "long_fraction": LONG_FRACTION, "workers": "1 prefill + 1 decode",
    }  # fmt: skip
    print(json.dumps({"config": config, **results, "short_ttft_p99_ratio": ratio}), flush=True)


def print_table(results: dict[str, Any]) -> None:
    print(f"{'':>14}{'short p50':>11}{'short p99':>11}{'long p50':>10}{'long p99':>10}"
          f"{'req/s':>8}{'tok/s':>8}{'429':>6}")  # fmt: skip
    for mode, r in results.items():
        s, lg = r["short"], r["long"]
        cells = [s["ttft_p50_s"], s["ttft_p99_s"], lg["ttft_p50_s"], lg["ttft_p99_s"]]
        print(f"{mode:>14}" + "".join(f"{c or 0:>10.2f}s" for c in cells[:2])
              + "".join(f"{c or 0:>9.2f}s" for c in cells[2:])
              + f"{r['throughput_req_per_s']:>8.2f}{r['prompt_tokens_per_s']:>8.0f}"
              + f"{r['rejected_429_rate']:>6.0%}")  # fmt: skip


if __name__ == "__main__":
    main()
