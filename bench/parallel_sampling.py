"""n samples of one prompt, through the router and real workers (1 prefill + 1 decode, as
`pdserve up` starts them): one request with n = N (the decode worker forks the samples after
the prefill) against N requests for the same prompt sent at once, seeded seed + i (what
fanning n out at the router would do), measured in the same run, each mode on its own prompt
of the same length so neither finds the other's prefix.

    python -m bench.parallel_sampling [--prompt-tokens 512] [--n 4] [--max-tokens 32]

Per mode: Prefill RPCs served, prompt tokens the prefill worker computed (prompt minus its
prefix hits, as usage reports them), KV bytes the decode worker received, and the wall time
until every sample is done. The last line of stdout is JSON with the ratios n / fanout."""

from __future__ import annotations

import argparse
import asyncio
import json
import time
import urllib.request
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from engine.model_files import resolve_model
from engine.tokenizer import TextTokenizer
from pdserve.launcher import ClusterSpec, LocalCluster
from pdserve.registry import Registry

MODEL = "smollm2-135m"
SEED = 7


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--cores", type=int, default=2)
    return parser.parse_args()


def sample_value(metrics_url: str, name: str, **labels: str) -> float:
    text = urllib.request.urlopen(metrics_url, timeout=10).read().decode()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return sample.value
    return 0.0


def counters(redis_url: str) -> dict[str, float]:
    registry = Registry(redis_url)
    (prefill,) = registry.workers("prefill")
    (decode,) = registry.workers("decode")
    return {
        "prefill_rpcs": sample_value(
            prefill.metrics_url, "pdserve_prefill_requests_total", outcome="ok"
        ),
        "kv_bytes_received": sample_value(
            decode.metrics_url, "pdserve_kv_transfer_bytes_total", direction="received"
        ),
    }


async def complete(client: httpx.AsyncClient, url: str, body: dict[str, Any]) -> dict[str, Any]:
    response = await client.post(f"{url}/v1/completions", json=body, timeout=600)
    response.raise_for_status()
    return response.json()


async def run_mode(url: str, prompt: list[int], args: argparse.Namespace, fork: bool):
    """Returns (the samples' texts by index, prompt tokens computed, wall s)."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": args.max_tokens,
            "temperature": 1.0, "ignore_eos": True}  # fmt: skip
    async with httpx.AsyncClient() as client:
        started = time.perf_counter()
        if fork:
            bodies = [body | {"n": args.n, "seed": SEED}]
        else:
            bodies = [body | {"seed": SEED + i} for i in range(args.n)]
        responses = await asyncio.gather(*(complete(client, url, b) for b in bodies))
        wall_s = time.perf_counter() - started
    texts = [c["text"] for r in responses for c in r["choices"]]
    computed = sum(
        r["usage"]["prompt_tokens"] - r["usage"]["prompt_tokens_details"]["cached_tokens"]
        for r in responses
    )
    return texts, computed, wall_s


def main() -> None:
    args = parse_args()
    tokenizer = TextTokenizer.load(resolve_model(MODEL))

    def prompt(tag: str) -> list[int]:
        text = " ".join(f"{tag} item {i} costs {i * 3} coins;" for i in range(args.prompt_tokens))
        return tokenizer.encode(text)[: args.prompt_tokens]

    spec = ClusterSpec(num_prefill=1, num_decode=1, kv_backend="tcp", num_cores=args.cores,
                       warmup=False, http_port=0, grpc_port=0)  # fmt: skip
    cluster = LocalCluster(spec).start()
    try:
        assert cluster.router is not None
        url = cluster.router.http_url
        asyncio.run(run_mode(url, prompt("warm")[:64], args, fork=True))  # first-run costs
        results: dict[str, Any] = {}
        texts: dict[str, list[str]] = {}
        for mode in ("n", "fanout"):
            before = counters(cluster.redis_url)
            texts[mode], computed, wall_s = asyncio.run(
                run_mode(url, prompt(mode), args, fork=mode == "n")
            )
            after = counters(cluster.redis_url)
            results[mode] = {name: after[name] - before[name] for name in before} | {
                "prefill_tokens_computed": computed, "wall_s": round(wall_s, 2),
            }  # fmt: skip
            print(mode, json.dumps(results[mode]), flush=True)
    finally:
        cluster.stop()
    # Temperature 1: every mode's samples differ (tests/router/test_router_n.py checks that
    # choice i is exactly the request seeded seed + i).
    assert all(len(set(t)) == args.n for t in texts.values()), texts
    ratios = {
        key: round(results["n"][key] / results["fanout"][key], 3)
        for key in ("prefill_rpcs", "prefill_tokens_computed", "kv_bytes_received", "wall_s")
        if results["fanout"][key]
    }
    print(json.dumps({"config": vars(args), **results, "n_vs_fanout": ratios}), flush=True)


if __name__ == "__main__":
    main()
