"""What the router adds to a request's latency: the same streams through the router's public
gRPC API and straight to the decode worker's gRPC (naming the prefill worker, as the router
does), on one local cluster as `pdserve up` starts it (Redis, 1 prefill + 1 decode worker, the
router; the decode worker's request limit and max_num_seqs raised to --streams + 16, as the
direct requests bypass the router's count of them).

A loaded pass sends --streams concurrent streaming requests along one path, each a short
prompt of --prompt-words random words (token ids, so that tokenizing is not counted; every
request its own words, no prefix cache hits) with --max-tokens greedy output tokens; each
round runs one pass per path, in turn first (direct then router, then router then direct), so
both paths see the same load and drift on a shared machine falls on both. (Mixing the paths in
one pass measured queue order instead: a routed request reaches the workers' FIFO queues a hop
after a direct one sent with it, so under a burst every routed request waited behind every
direct one.) Per path: TTFT (send to the first message with a token) and inter-token latency
(the gap between token-carrying messages, over their tokens) p50/p99, pooled over --rounds
rounds; "added" is the router's figure minus the direct one. One stream (--light-requests
requests in turn, alternating the paths) separates the router's own cost from queueing under
load. The last line of stdout is one JSON object with "added_ttft_ms" and "added_itl_ms"
({"p50", "p99"}, under load), the one-stream ones, both paths' figures, and the targets (added
TTFT p50 <= 1 ms, p99 <= 5 ms; added ITL p50 <= 0.5 ms).
Run from the repository root: python -m bench.router_overhead.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import grpc

from bench.serve import percentile, word_ids
from engine.model_files import resolve_model
from engine.tokenizer import TextTokenizer
from pdserve.launcher import ClusterSpec, LocalCluster
from pdserve.registry import Registry
from pdserve.v1 import generation_pb2 as pb
from pdserve.v1 import generation_pb2_grpc
from pdserve.worker.v1 import worker_pb2 as wpb
from pdserve.worker.v1 import worker_pb2_grpc

TARGETS_MS = {"ttft_p50": 1.0, "ttft_p99": 5.0, "itl_p50": 0.5}
PATHS = ("direct", "router")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=200)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--prompt-words", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=2, help="loaded passes per path")
    parser.add_argument("--light-requests", type=int, default=20, help="one stream, per path")
    parser.add_argument("--cores", type=int, default=0, help="0 = all; split among the workers")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args()


@dataclass
class Latencies:
    ttft_s: list[float] = field(default_factory=list)
    itl_s: list[float] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)

    def summary(self) -> dict[str, Any]:
        def ms(values: list[float], q: int) -> float | None:
            value = percentile(values, q)
            return None if value is None else round(value * 1000, 3)

        return {
            "requests": len(self.ttft_s), "failures": len(self.failures),
            "ttft_ms": {"p50": ms(self.ttft_s, 50), "p99": ms(self.ttft_s, 99)},
            "itl_ms": {"p50": ms(self.itl_s, 50), "p99": ms(self.itl_s, 99)},
        }  # fmt: skip


async def stream(call: grpc.aio.UnaryStreamCall, into: Latencies, started_s: float) -> None:
    """Reads one streaming call to its end, timing its token-carrying messages."""
    last_s: float | None = None
    try:
        async for message in call:
            if not message.token_ids:
                continue
            now_s = time.monotonic()
            if last_s is None:
                into.ttft_s.append(now_s - started_s)
            else:
                gap_s = (now_s - last_s) / len(message.token_ids)
                into.itl_s.extend([gap_s] * len(message.token_ids))
            last_s = now_s
    except grpc.aio.AioRpcError as e:
        into.failures.append(f"{e.code().name}: {e.details()}")


class Paths:
    """The two ways to the same workers, each request built from its own prompt."""

    def __init__(self, router_address: str, decode_address: str, prefill_address: str) -> None:
        self.router = generation_pb2_grpc.GenerationStub(grpc.aio.insecure_channel(router_address))
        self.decode = worker_pb2_grpc.DecodeStub(grpc.aio.insecure_channel(decode_address))
        self.prefill_address = prefill_address

    def call(self, path: str, prompt: list[int], max_tokens: int) -> grpc.aio.UnaryStreamCall:
        params = pb.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        if path == "router":
            return self.router.Generate(
                pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt), params=params), timeout=600
            )
        request = wpb.DecodeRequest(
            request_id=uuid.uuid4().hex, prompt_token_ids=prompt, params=params,
            prefill_address=self.prefill_address,
        )  # fmt: skip
        return self.decode.Generate(request, timeout=600)


async def run_pass(paths: Paths, prompts: list[list[int]], max_tokens: int,
                   into: dict[str, Latencies], route: list[str],
                   concurrent: bool) -> None:  # fmt: skip
    """Request i goes along route[i]: all at once, or one after another."""

    async def one(i: int, prompt: list[int]) -> None:
        path = route[i]
        started_s = time.monotonic()
        await stream(paths.call(path, prompt, max_tokens), into[path], started_s)

    if concurrent:
        await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
    else:
        for i, prompt in enumerate(prompts):
            await one(i, prompt)


def added(router: dict[str, Any], direct: dict[str, Any]) -> dict[str, Any]:
    def diff(a: float | None, b: float | None) -> float | None:
        return None if a is None or b is None else round(a - b, 3)

    return {
        part: {q: diff(router[part][q], direct[part][q]) for q in ("p50", "p99")}
        for part in ("ttft_ms", "itl_ms")
    }


async def measure(args: argparse.Namespace, addresses: tuple[str, str, str],
                  words: list[int]) -> dict[str, Any]:  # fmt: skip
    paths = Paths(*addresses)  # grpc.aio channels belong to the loop they are made on
    rng = random.Random(args.seed)

    def prompts(n: int) -> list[list[int]]:
        return [rng.sample(words, args.prompt_words) for _ in range(n)]

    def alternating(n: int) -> list[str]:
        return [PATHS[i % 2] for i in range(n)]

    # A pass untimed: channels connected, the first batch sizes seen.
    await run_pass(paths, prompts(8), args.max_tokens, {p: Latencies() for p in PATHS},
                   alternating(8), concurrent=True)  # fmt: skip
    results: dict[str, Any] = {}
    loaded = {path: Latencies() for path in PATHS}
    for round_ in range(args.rounds):
        for path in PATHS if round_ % 2 == 0 else PATHS[::-1]:
            await run_pass(paths, prompts(args.streams), args.max_tokens, loaded,
                           [path] * args.streams, concurrent=True)  # fmt: skip
    light = {path: Latencies() for path in PATHS}
    n = 2 * args.light_requests
    await run_pass(paths, prompts(n), args.max_tokens, light, alternating(n), concurrent=False)
    for load, by_path in (("loaded", loaded), ("one_stream", light)):
        summaries = {path: lat.summary() for path, lat in by_path.items()}
        results[load] = summaries | {"added": added(summaries["router"], summaries["direct"])}
    return results


def main() -> None:
    args = parse_args()
    words = word_ids(TextTokenizer.load(resolve_model("smollm2-135m")))
    # The direct passes go around the router's count of what the decode worker takes at once
    # (its RPC limit and max_num_seqs): both are raised so that a direct pass fits, as a routed
    # one does.
    room = str(args.streams + 16)
    limits = ("--max-concurrent-rpcs", room, "--max-num-seqs", room)
    spec = ClusterSpec(http_port=0, grpc_port=0, num_cores=args.cores, worker_args=limits)
    cluster = LocalCluster(spec).start()
    try:
        assert cluster.router is not None
        registry = Registry(cluster.redis_url)
        (prefill,), (decode,) = registry.workers("prefill"), registry.workers("decode")
        addresses = (cluster.router.grpc_address, decode.address, prefill.address)
        results = asyncio.run(measure(args, addresses, words))
    finally:
        cluster.stop()
    loaded, light = results["loaded"]["added"], results["one_stream"]["added"]
    print(f"{'':12} {'path':7} {'TTFT p50':>10} {'p99':>10} {'ITL p50':>10} {'p99':>10}  (ms)")
    for load, by_path in results.items():
        for path in ("direct", "router", "added"):
            row = by_path[path]
            print(f"{load:12} {path:7} {row['ttft_ms']['p50']!s:>10} {row['ttft_ms']['p99']!s:>10}"
                  f" {row['itl_ms']['p50']!s:>10} {row['itl_ms']['p99']!s:>10}")  # fmt: skip
    met = {
        name: value is not None and value <= TARGETS_MS[name]
        for name, value in (("ttft_p50", loaded["ttft_ms"]["p50"]),
                            ("ttft_p99", loaded["ttft_ms"]["p99"]),
                            ("itl_p50", loaded["itl_ms"]["p50"]))
    }  # fmt: skip
    print(json.dumps({
        "streams": args.streams, "max_tokens": args.max_tokens,
        "added_ttft_ms": loaded["ttft_ms"], "added_itl_ms": loaded["itl_ms"],
        "one_stream": {"added_ttft_ms": light["ttft_ms"], "added_itl_ms": light["itl_ms"]},
        "paths": results, "targets_ms": TARGETS_MS, "met": met,
    }))  # fmt: skip


if __name__ == "__main__":
    main()
