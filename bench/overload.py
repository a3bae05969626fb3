"""Shedding under a real open-loop overload: a TTFT objective against `pdserve up`.

One local cluster as `pdserve up` starts it (Redis, 1 prefill + 1 decode worker, the router with
--ttft-slo-s), but with the router's own prefill overflow (queue): admission predicts TTFT from
the prefill pool, which is what this measures against what requests see. Streaming
completions of --prompt-tokens random words (no prefix cache hits) and --max-tokens output
tokens through the OpenAI API:
  capacity  a closed loop of --capacity-streams clients, --capacity-requests requests, through a
            second router on the same workers with no objective (shedding would make the loop
            look faster): completed req/s. --capacity-rps skips it.
  loads     for each of --loads (default 2.0 then 0.7) an open loop through the objective's
            router: Poisson arrivals at load x capacity for --duration-s, each request sent at
            its arrival time however many are outstanding.
Per load: admitted requests' TTFT p50/p99 (client side: send to the first token's chunk), the
TTFT the router predicted for each (its x-pdserve-predicted-ttft-s header) against the one
observed (p50 of |predicted - observed| / observed, and predicted p50 / observed p50), the shed
count and fraction, whether every 429 carried Retry-After, the router's rejections by reason and
its learned correction. The last line of stdout is one JSON object: the capacity, the objective,
each load's results and pass flags (overload: admitted p99 within the objective, prediction
error within --max-prediction-error, every 429 with Retry-After; underload: nothing shed).
Run from the repository root: python -m bench.overload.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from bench.serve import percentile, word_ids
from engine.model_files import resolve_model
from engine.tokenizer import TextTokenizer
from pdserve.launcher import ClusterSpec, LocalCluster, RouterEndpoint
from router.http_api.app import PREDICTED_TTFT_HEADER

Prompt = list[int]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ttft-slo-s", type=float, default=30.0, help="the router's objective")
    parser.add_argument("--capacity-rps", type=float, default=0.0, help="0: measure it")
    parser.add_argument("--capacity-streams", type=int, default=16)
    parser.add_argument("--capacity-requests", type=int, default=48)
    parser.add_argument("--loads", default="2.0,0.7", help="multiples of capacity, in order")
    parser.add_argument("--duration-s", type=float, default=120.0, help="arrivals, per load")
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--max-prediction-error", type=float, default=0.25)
    parser.add_argument("--cores", type=int, default=0, help="0 = all; split among the workers")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args()


async def send(client: httpx.AsyncClient, url: str, prompt: Prompt, max_tokens: int) -> dict:
    """One streaming completion: status, client-side TTFT and the router's headers."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True}  # fmt: skip
    started_s = time.monotonic()
    outcome: dict[str, Any] = {"started_s": started_s}
    async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
        outcome["status"] = response.status_code
        outcome["retry_after"] = response.headers.get("retry-after")
        predicted = response.headers.get(PREDICTED_TTFT_HEADER)
        outcome["predicted_ttft_s"] = None if predicted is None else float(predicted)
        if response.status_code != 200:
            outcome["error"] = (await response.aread()).decode(errors="replace")[:300]
            return outcome
        async for line in response.aiter_lines():
            if line == "data: [DONE]":
                outcome["done"] = True
                break
            if "ttft_s" not in outcome and line.startswith("data: {") and '"text": ""' not in line:
                outcome["ttft_s"] = time.monotonic() - started_s
    return outcome


def new_client(num_connections: int) -> httpx.AsyncClient:
    limits = httpx.Limits(max_connections=num_connections, max_keepalive_connections=32)
    return httpx.AsyncClient(timeout=900, limits=limits)


async def closed_loop(url: str, prompts: list[Prompt], streams: int, max_tokens: int) -> tuple:
    pending = iter(prompts)
    outcomes: list[dict] = []

    async def client_loop(client: httpx.AsyncClient) -> None:
        for prompt in pending:
            outcomes.append(await send(client, url, prompt, max_tokens))

    started_s = time.monotonic()
    async with new_client(streams + 2) as client:
        await asyncio.gather(*(client_loop(client) for _ in range(streams)))
    return outcomes, time.monotonic() - started_s


async def open_loop(
    url: str, prompts: list[Prompt], arrivals_s: list[float], max_tokens: int
) -> list[dict]:
    """Sends prompt i at arrivals_s[i] (seconds from now) whatever is still outstanding."""
    async with new_client(len(prompts) + 2) as client:
        start_s = time.monotonic()
        tasks = []
        for prompt, arrival_s in zip(prompts, arrivals_s, strict=True):
            await asyncio.sleep(max(0.0, start_s + arrival_s - time.monotonic()))
            tasks.append(asyncio.create_task(send(client, url, prompt, max_tokens)))
        outcomes = await asyncio.gather(*tasks)
    for outcome, arrival_s in zip(outcomes, arrivals_s, strict=True):
        outcome["arrival_s"] = arrival_s
        outcome["late_s"] = outcome.pop("started_s") - start_s - arrival_s
    return list(outcomes)


def poisson_arrivals(rate_per_s: float, duration_s: float, rng: random.Random) -> list[float]:
    arrivals_s, now_s = [], rng.expovariate(rate_per_s)
    while now_s < duration_s:
        arrivals_s.append(now_s)
        now_s += rng.expovariate(rate_per_s)
    return arrivals_s


def router_samples(router: RouterEndpoint) -> dict[str, float]:
    """Rejections by reason (summed over buckets) and the learned TTFT correction per pool."""
    text = httpx.get(f"{router.http_url}/metrics", timeout=10).text
    samples: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "pdserve_router_rejections_total":
                key = f"rejected_{sample.labels['reason']}"
                samples[key] = samples.get(key, 0.0) + sample.value
            elif sample.name == "pdserve_router_ttft_correction":
                samples[f"correction_{sample.labels['pool']}"] = sample.value
    return samples


def summarize(
    outcomes: list[dict], duration_s: float, before: dict[str, float], after: dict[str, float]
) -> dict[str, Any]:
    admitted = [o for o in outcomes if o["status"] == 200 and "ttft_s" in o]
    shed = [o for o in outcomes if o["status"] == 429]
    ttfts = [o["ttft_s"] for o in admitted]
    predicted = [o["predicted_ttft_s"] for o in admitted]
    errors = [abs(p - t) / t for p, t in zip(predicted, ttfts, strict=True)]
    signed = [(p - t) / t for p, t in zip(predicted, ttfts, strict=True)]
    halves = [[o["ttft_s"] for o in admitted if (o["arrival_s"] < duration_s / 2) == first]
              for first in (True, False)]  # fmt: skip
    observed_p50, predicted_p50 = percentile(ttfts, 50), percentile(predicted, 50)
    rejections = {k.removeprefix("rejected_"): round(after[k] - before.get(k, 0.0))
                  for k in after if k.startswith("rejected_")}  # fmt: skip
    return {
        "arrivals": len(outcomes),
        "admitted": len(admitted),
        "completed": sum(bool(o.get("done")) for o in admitted),
        "shed": len(shed),
        "shed_fraction": _round(len(shed) / max(1, len(outcomes))),
        "shed_without_retry_after": sum(o["retry_after"] is None for o in shed),
        "other_statuses": sorted({o["status"] for o in outcomes} - {200, 429}),
        "other_errors": [o.get("error") for o in outcomes if o["status"] not in (200, 429)][:3],
        "rejections_by_reason": {k: v for k, v in rejections.items() if v},
        "admitted_per_s": _round(len(admitted) / duration_s),
        "ttft_p50_s": _round(observed_p50),
        "ttft_p99_s": _round(percentile(ttfts, 99)),
        "ttft_max_s": _round(max(ttfts, default=None)),
        "ttft_p99_first_half_s": _round(percentile(halves[0], 99)),
        "ttft_p99_second_half_s": _round(percentile(halves[1], 99)),
        "predicted_ttft_p50_s": _round(predicted_p50),
        "predicted_ttft_p99_s": _round(percentile(predicted, 99)),
        # p50 of |predicted - observed| / observed, and the median signed error (< 0: optimistic)
        "prediction_error_p50": _round(percentile(errors, 50)),
        "prediction_signed_error_p50": _round(percentile(signed, 50)),
        "predicted_over_observed_p50": _round(
            predicted_p50 / observed_p50 if predicted_p50 and observed_p50 else None
        ),
        "correction_after": {
            k.removeprefix("correction_"): _round(v)
            for k, v in after.items()
            if k.startswith("correction_")
        },
        "send_late_p99_s": _round(percentile([o["late_s"] for o in outcomes], 99)),
        "retry_after_s_median": _round(
            statistics.median(int(o["retry_after"]) for o in shed if o["retry_after"])
            if any(o["retry_after"] for o in shed)
            else None
        ),  # fmt: skip
    }


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 4)


def measure_capacity(cluster: LocalCluster, args, prompts: list[Prompt]) -> dict[str, Any]:
    router = cluster.add_router("router-capacity", ("--log-level", "warning"))
    try:
        loop = closed_loop(router.http_url, prompts, args.capacity_streams, args.max_tokens)
        outcomes, wall_s = asyncio.run(loop)
    finally:
        cluster.remove_router(router)
    done = [o for o in outcomes if o.get("done")]
    ttfts = [o["ttft_s"] for o in done if "ttft_s" in o]
    return {
        "requests": len(outcomes),
        "completed": len(done),
        "wall_s": round(wall_s, 2),
        "rps": _round(len(done) / wall_s),
        "ttft_p50_s": _round(percentile(ttfts, 50)),
        "ttft_p99_s": _round(percentile(ttfts, 99)),
    }


def criteria(results: dict[str, dict], loads: list[float], args) -> dict[str, bool]:
    flags: dict[str, bool] = {}
    for load in loads:
        r, name = results[str(load)], f"load_{load}"
        if load > 1.0:
            p99, error = r["ttft_p99_s"], r["prediction_error_p50"]
            flags[f"{name}_sheds"] = r["shed"] > 0
            flags[f"{name}_ttft_p99_within_slo"] = p99 is not None and p99 <= args.ttft_slo_s
            flags[f"{name}_prediction_within_{args.max_prediction_error}"] = (
                error is not None and error <= args.max_prediction_error
            )
            flags[f"{name}_every_429_has_retry_after"] = r["shed_without_retry_after"] == 0
        else:
            flags[f"{name}_sheds_nothing"] = r["shed"] == 0
        flags[f"{name}_no_other_errors"] = not r["other_statuses"]
    flags["all"] = all(flags.values())
    return flags


def main() -> None:
    args = parse_args()
    started_s = time.monotonic()
    loads = [float(x) for x in args.loads.split(",")]
    words = word_ids(TextTokenizer.load(resolve_model("smollm2-135m")))
    rng = random.Random(args.seed)

    def prompts(n: int) -> list[Prompt]:  # fresh words every request: no prefix hits
        return [[rng.choice(words) for _ in range(args.prompt_tokens)] for _ in range(n)]

    spec = ClusterSpec(dtype=args.dtype, kv_backend="tcp", num_cores=args.cores, http_port=0,
                       grpc_port=0, router_args=("--ttft-slo-s", str(args.ttft_slo_s),
                                                 "--log-level", "warning"))  # fmt: skip
    cluster = LocalCluster(spec).start()
    try:
        router = cluster.router
        assert router is not None
        capacity: dict[str, Any] = {"given_rps": args.capacity_rps}
        if not args.capacity_rps:
            capacity = measure_capacity(cluster, args, prompts(args.capacity_requests))
            print("capacity", json.dumps(capacity), flush=True)
        capacity_rps = args.capacity_rps or capacity["rps"]
        results = {}
        for load in loads:
            arrivals_s = poisson_arrivals(load * capacity_rps, args.duration_s, rng)
            before = router_samples(router)
            outcomes = asyncio.run(open_loop(router.http_url, prompts(len(arrivals_s)),
                                             arrivals_s, args.max_tokens))  # fmt: skip
            results[str(load)] = {"rate_per_s": _round(load * capacity_rps)} | summarize(
                outcomes, args.duration_s, before, router_samples(router)
            )
            print(f"load {load}", json.dumps(results[str(load)]), flush=True)
    finally:
        cluster.stop()
    print(f"({time.monotonic() - started_s:.0f} s; logs in {cluster.log_dir})")
    print(json.dumps({"config": vars(args), "ttft_slo_s": args.ttft_slo_s,
                      "capacity_rps": capacity_rps, "capacity": capacity, "loads": results,
                      "pass": criteria(results, loads, args)}), flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
