"""Aggregated vs disaggregated serving on this machine, same router, same workload.

Three modes, each through its own router on loopback (OpenAI HTTP, streaming completions):
  disaggregated  1 prefill + 1 decode worker (the cores split between them), length-aware
  fifo           the same workers, FIFO admission
  aggregated     1 aggregated worker (`decode --aggregated`) with all the cores
Each mode runs a closed loop of --streams clients and then of one client, over prompts of
--prompt-tokens random words (no prefix cache hits) and --max-tokens output tokens. The router
runs its default admission (no TTFT objective) unless --ttft-slo-s sets one.

Per mode and loop: req/s, TTFT p50/p99, inter-token p50, the 429 rate, and the router's
queue-wait prediction error (observed minus predicted mean wait, relative to the observed,
from pdserve_router_queue_wait[_predicted]_seconds). The last line of stdout is JSON with
aggregated_vs_disaggregated_rps (per loop: aggregated req/s / disaggregated req/s) and
shed_fraction per mode.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import random
import sys
import time
from pathlib import Path
from typing import Any

_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]
sys.path.insert(0, str(_HERE.parent))

import httpx  # noqa: E402

from engine.model_files import resolve_model  # noqa: E402
from engine.tokenizer import TextTokenizer  # noqa: E402
from pdserve.launcher import ClusterSpec, LocalCluster, RouterEndpoint  # noqa: E402

_spec = importlib.util.spec_from_file_location("bench_serve", _HERE / "serve.py")
assert _spec is not None and _spec.loader is not None
serve = sys.modules["bench_serve"] = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(serve)

# mode: (prefill, decode, aggregated workers, admission)
MODES = {
    "disaggregated": (1, 1, 0, "length_aware"),
    "fifo": (1, 1, 0, "fifo"),
    "aggregated": (0, 0, 1, "length_aware"),
}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=32, help="closed-loop clients")
    parser.add_argument("--requests", type=int, default=64, help="per mode, --streams loop")
    parser.add_argument("--single-requests", type=int, default=6, help="per mode, one client")
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--ttft-slo-s", type=float, default=0.0, help="0: the router's default")
    parser.add_argument("--max-seconds", type=float, default=600.0, help="per loop")
    parser.add_argument("--cores", type=int, default=0, help="0 = all; split among the workers")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--modes", default=",".join(MODES), help="comma-separated subset")
    return parser.parse_args()


async def send(client: httpx.AsyncClient, url: str, prompt: list[int], max_tokens: int) -> dict:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True}  # fmt: skip
    started = time.monotonic()
    arrivals: list[float] = []
    async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
        if response.status_code != 200:
            await response.aread()
            return {"status": response.status_code}
        async for line in response.aiter_lines():
            if line == "data: [DONE]":
                break
            if line.startswith("data: {") and '"text": ""' not in line:
                arrivals.append(time.monotonic())
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:], strict=False)]
    ttft_s = arrivals[0] - started if arrivals else None
    return {"status": 200, "ttft_s": ttft_s, "gaps": gaps}


async def closed_loop(url: str, prompts: list[list[int]], streams: int, args) -> tuple:
    pending = iter(prompts)
    outcomes: list[dict] = []
    started = time.monotonic()
    deadline = started + args.max_seconds

    async def client_loop(client: httpx.AsyncClient) -> None:
        for prompt in pending:
            if time.monotonic() > deadline:
                return
            outcomes.append(await send(client, url, prompt, args.max_tokens))

    limits = httpx.Limits(max_connections=streams + 2)
    async with httpx.AsyncClient(timeout=900, limits=limits) as client:
        await asyncio.gather(*(client_loop(client) for _ in range(streams)))
    return outcomes, time.monotonic() - started


def queue_wait_sums(router: RouterEndpoint) -> dict[str, float]:
    """Sum and count of observed and predicted router queue waits, over every bucket."""
    sums = {"observed": 0.0, "predicted": 0.0, "count": 0.0}
    names = {"pdserve_router_queue_wait_seconds_sum": "observed",
             "pdserve_router_queue_wait_predicted_seconds_sum": "predicted",
             "pdserve_router_queue_wait_seconds_count": "count"}  # fmt: skip
    for line in httpx.get(f"{router.http_url}/metrics", timeout=10).text.splitlines():
        name = line.split("{")[0]
        if name in names:
            sums[names[name]] += float(line.rsplit(" ", 1)[1])
    return sums


def summarize(outcomes: list[dict], wall_s: float, before: dict, after: dict) -> dict[str, Any]:
    done = [o for o in outcomes if o["status"] == 200]
    ttfts = [o["ttft_s"] for o in done if o["ttft_s"] is not None]
    gaps = [g for o in done for g in o["gaps"]]
    observed = after["observed"] - before["observed"]
    predicted = after["predicted"] - before["predicted"]
    count = after["count"] - before["count"]
    return {
        "requests": len(outcomes),
        "completed": len(done),
        "shed_fraction": round(
            sum(o["status"] == 429 for o in outcomes) / max(1, len(outcomes)), 4
        ),
        "errors": sum(o["status"] not in (200, 429) for o in outcomes),
        "wall_s": round(wall_s, 2),
        "req_per_s": round(len(done) / wall_s, 4),
        "ttft_p50_s": _round(serve.percentile(ttfts, 50)),
        "ttft_p99_s": _round(serve.percentile(ttfts, 99)),
        "itl_p50_s": _round(serve.percentile(gaps, 50)),
        "queue_wait_mean_s": _round(observed / count if count else None),
        "queue_wait_predicted_mean_s": _round(predicted / count if count else None),
        # Relative error of the mean prediction; None when nothing waited (both ~0).
        "wait_prediction_error": _round(
            (observed - predicted) / observed if observed > 0.05 * max(1, count) else None
        ),
    }


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 4)


def run_mode(mode: str, args, prompts: dict[str, list[list[int]]]) -> dict[str, Any]:
    num_prefill, num_decode, num_aggregated, admission = MODES[mode]
    spec = ClusterSpec(num_prefill=num_prefill, num_decode=num_decode,
                       num_aggregated=num_aggregated, dtype=args.dtype, kv_backend="tcp",
                       num_cores=args.cores, warmup=False, with_router=False)  # fmt: skip
    cluster = LocalCluster(spec).start()
    try:
        router = cluster.add_router(f"router-{mode}", (
            "--admission", admission, "--ttft-slo-s", str(args.ttft_slo_s),
            "--log-level", "warning",
        ))  # fmt: skip
        asyncio.run(closed_loop(router.http_url, prompts["warmup"], 1, args))  # not measured
        results = {}
        for loop, streams in (("streams", args.streams), ("single", 1)):
            before = queue_wait_sums(router)
            outcomes, wall_s = asyncio.run(closed_loop(router.http_url, prompts[loop], streams,
                                                       args))  # fmt: skip
            results[loop] = summarize(outcomes, wall_s, before, queue_wait_sums(router))
            print(mode, loop, json.dumps(results[loop]), flush=True)
        return results
    finally:
        cluster.stop()


def main() -> None:
    args = parse_args()
    started = time.monotonic()
    words = serve.word_ids(TextTokenizer.load(resolve_model("smollm2-135m")))
    rng = random.Random(args.seed)

    def prompts(n: int) -> list[list[int]]:  # fresh words every request: no prefix hits
        return [[rng.choice(words) for _ in range(args.prompt_tokens)] for _ in range(n)]

    results = {}
    modes = args.modes.split(",")
    assert {"disaggregated", "aggregated"} <= set(modes) <= set(MODES), args.modes
    for mode in modes:
        workload = {"warmup": prompts(2), "streams": prompts(args.requests),
                    "single": prompts(args.single_requests)}  # fmt: skip
        results[mode] = run_mode(mode, args, workload)
    ratios = {}
    for loop in ("streams", "single"):
        disaggregated = results["disaggregated"][loop]["req_per_s"]
        ratios[loop] = _round(results["aggregated"][loop]["req_per_s"] / disaggregated
                              if disaggregated else None)  # fmt: skip
    shed = {mode: {loop: r[loop]["shed_fraction"] for loop in r} for mode, r in results.items()}
    print(f"({time.monotonic() - started:.0f} s)")
    print(json.dumps({"config": vars(args), **results,
                      "aggregated_vs_disaggregated_rps": ratios,
                      "shed_fraction": shed}), flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
