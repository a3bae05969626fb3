"""What the router adds to a request's latency: the same streams through the router's public
gRPC API and straight to the decode worker's gRPC (naming the prefill worker, as the router
does), on one local cluster as `pdserve up` starts it (Redis, 1 prefill + 1 decode worker, the
router; the decode worker's request limit and max_num_seqs raised to --streams + 16, as the
direct requests bypass the router's count of them).

A loaded pass sends --streams concurrent streaming requests along one path, each a short
prompt of --prompt-words random words (token ids, so that tokenizing is not counted; every
request its own words, no prefix cache hits) with --max-tokens greedy output tokens; each
round runs one pass per path, in turn first (direct then router, then router then direct), so
both paths see the same load and drift on a shared machine falls on both. Each pass starts
once the workers' heartbeats report them idle: the router learns of direct requests only from
those. (Mixing the paths in one pass measured queue order instead: a routed request reaches
the workers' FIFO queues a hop after a direct one sent with it, so under a burst every routed
request waited behind every direct one.) Per path: TTFT (send to the first message with a
token) and inter-token latency (the gap between token-carrying messages, over their tokens)
p50/p99, pooled over --rounds rounds; "added" is the router's figure minus the direct one.
One stream (--light-requests requests in turn, alternating the paths) separates the router's
own cost from queueing under load.

The transport floor, measured in the same run with no model: a stand-in decode service (its own
process) answers every call with its first token --floor-first-token-s after the call arrives
and the rest --floor-token-gap-s apart, and a bare relay (its own process, one grpc.aio loop,
as the router's) forwards each call to it and each message back; the same passes go straight
to the stand-in and through the relay. What the relay adds is what one Python gRPC hop costs
on this host before any routing logic: the least a router written this way can add.

The last line of stdout is one JSON object with "added_ttft_ms" and "added_itl_ms" ({"p50",
"p99"}, under load), the one-stream ones, both paths' figures, "transport_floor" (the
relay's, the same way), and the targets (added TTFT p50 <= 1 ms, p99 <= 5 ms; added ITL p50
<= 0.5 ms).
Run from the repository root: python -m bench.router_overhead.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import random
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import grpc

from bench.serve import percentile, word_ids
from engine.model_files import resolve_model
from engine.tokenizer import TextTokenizer
from pdserve.launcher import ClusterSpec, LocalCluster
from pdserve.redis_server import free_port
from pdserve.registry import Registry
from pdserve.v1 import generation_pb2 as pb
from pdserve.v1 import generation_pb2_grpc
from pdserve.worker.v1 import worker_pb2 as wpb
from pdserve.worker.v1 import worker_pb2_grpc
from router.settings import RouterSettings

TARGETS_MS = {"ttft_p50": 1.0, "ttft_p99": 5.0, "itl_p50": 0.5}
HOST = "127.0.0.1"


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=200)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--prompt-words", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=2, help="loaded passes per path")
    parser.add_argument("--light-requests", type=int, default=20, help="one stream, per path")
    parser.add_argument("--cores", type=int, default=0, help="0 = all; split among the workers")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--floor-first-token-s", type=float, default=1.0)
    parser.add_argument("--floor-token-gap-s", type=float, default=0.05)
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


Call = Callable[[list[int], int], grpc.aio.UnaryStreamCall]  # (prompt, max_tokens)


def greedy(max_tokens: int) -> pb.SamplingParams:
    return pb.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def decode_call(address: str, prefill_address: str = "") -> Call:
    """Straight to a decode service's gRPC, as the router calls it."""
    stub = worker_pb2_grpc.DecodeStub(grpc.aio.insecure_channel(address))

    def call(prompt: list[int], max_tokens: int) -> grpc.aio.UnaryStreamCall:
        request = wpb.DecodeRequest(
            request_id=uuid.uuid4().hex, prompt_token_ids=prompt, params=greedy(max_tokens),
            prefill_address=prefill_address,
        )  # fmt: skip
        return stub.Generate(request, timeout=600)

    return call


def router_call(address: str) -> Call:
    """Through the router's public gRPC API."""
    stub = generation_pb2_grpc.GenerationStub(grpc.aio.insecure_channel(address))

    def call(prompt: list[int], max_tokens: int) -> grpc.aio.UnaryStreamCall:
        request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt), params=greedy(max_tokens))
        return stub.Generate(request, timeout=600)

    return call


class StandIn(worker_pb2_grpc.DecodeServicer):
    """The transport floor's decode service: no model, the same shape of stream."""

    def __init__(self, first_token_s: float, token_gap_s: float) -> None:
        self.first_token_s = first_token_s
        self.token_gap_s = token_gap_s

    async def Generate(
        self, request: wpb.DecodeRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        await asyncio.sleep(self.first_token_s)
        for i in range(request.params.max_tokens):
            if i:
                await asyncio.sleep(self.token_gap_s)
            last = i == request.params.max_tokens - 1
            yield pb.GenerateResponse(token_ids=[i], finish_reason="length" if last else "")


class BareRelay(worker_pb2_grpc.DecodeServicer):
    """The transport floor's hop: every call forwarded, every message passed back."""

    def __init__(self, target: str) -> None:
        self.target = target
        self.stub: worker_pb2_grpc.DecodeStub | None = None

    async def Generate(
        self, request: wpb.DecodeRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        if self.stub is None:  # a channel belongs to the loop it is made on: the server's
            self.stub = worker_pb2_grpc.DecodeStub(grpc.aio.insecure_channel(self.target))
        async for message in self.stub.Generate(request, timeout=context.time_remaining()):
            yield message


def serve(port: int, servicer: worker_pb2_grpc.DecodeServicer) -> None:
    """A process's whole life: one grpc.aio server on its own loop, until terminated."""

    async def run() -> None:
        server = grpc.aio.server()
        worker_pb2_grpc.add_DecodeServicer_to_server(servicer, server)
        server.add_insecure_port(f"{HOST}:{port}")
        await server.start()
        await server.wait_for_termination()

    asyncio.run(run())


async def run_pass(calls: dict[str, Call], prompts: list[list[int]], max_tokens: int,
                   into: dict[str, Latencies], route: list[str],
                   concurrent: bool) -> None:  # fmt: skip
    """Request i goes along route[i]: all at once, or one after another."""

    async def one(i: int, prompt: list[int]) -> None:
        path = route[i]
        started_s = time.monotonic()
        await stream(calls[path](prompt, max_tokens), into[path], started_s)

    if concurrent:
        await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
    else:
        for i, prompt in enumerate(prompts):
            await one(i, prompt)


def added(hop: dict[str, Any], direct: dict[str, Any]) -> dict[str, Any]:
    def diff(a: float | None, b: float | None) -> float | None:
        return None if a is None or b is None else round(a - b, 3)

    return {
        part: {q: diff(hop[part][q], direct[part][q]) for q in ("p50", "p99")}
        for part in ("ttft_ms", "itl_ms")
    }


async def heartbeats_idle(registry: Registry, router_refresh_s: float) -> None:
    """Returns once every worker's heartbeat after this call reports it idle, and the router
    has read them. A direct pass goes around the router's count of what it sent: the router
    learns of those requests only from heartbeats, and a routed pass started before the
    heartbeat after they ended would wait up to a heartbeat behind requests already gone."""
    since_s = time.time()

    def idle() -> bool:
        return all(
            w.updated_at > since_s
            and w.load.queued_tokens == w.load.running_requests == w.load.waiting_requests == 0
            for w in registry.workers("prefill") + registry.workers("decode")
        )

    while not await asyncio.to_thread(idle):
        await asyncio.sleep(0.1)
    await asyncio.sleep(2 * router_refresh_s)


async def no_wait() -> None:
    pass


async def measure(
    args: argparse.Namespace, make_calls: Callable[[], dict[str, Call]], words: list[int],
    settle: Callable[[], Awaitable[None]],
) -> dict[str, Any]:  # fmt: skip
    """Both paths of make_calls() (the direct one first), loaded and one stream at a time,
    each pass started once settle() returns; "added" is the second path's figure minus the
    direct one."""
    calls = make_calls()  # grpc.aio channels belong to the loop they are made on
    paths = tuple(calls)
    rng = random.Random(args.seed)

    def prompts(n: int) -> list[list[int]]:
        return [rng.sample(words, args.prompt_words) for _ in range(n)]

    def alternating(n: int) -> list[str]:
        return [paths[i % 2] for i in range(n)]

    # A pass untimed: channels connected, the first batch sizes seen.
    await run_pass(calls, prompts(8), args.max_tokens, {p: Latencies() for p in paths},
                   alternating(8), concurrent=True)  # fmt: skip
    results: dict[str, Any] = {}
    loaded = {path: Latencies() for path in paths}
    for round_ in range(args.rounds):
        for path in paths if round_ % 2 == 0 else paths[::-1]:
            await settle()
            await run_pass(calls, prompts(args.streams), args.max_tokens, loaded,
                           [path] * args.streams, concurrent=True)  # fmt: skip
    light = {path: Latencies() for path in paths}
    n = 2 * args.light_requests
    await settle()
    await run_pass(calls, prompts(n), args.max_tokens, light, alternating(n), concurrent=False)
    for load, by_path in (("loaded", loaded), ("one_stream", light)):
        summaries = {path: lat.summary() for path, lat in by_path.items()}
        results[load] = summaries | {"added": added(summaries[paths[1]], summaries[paths[0]])}
    return results


def transport_floor(args: argparse.Namespace, words: list[int]) -> dict[str, Any]:
    """measure() on the stand-in, straight and through the bare relay, each in its own
    process (spawned: a forked child would share this process's gRPC state)."""
    stand_in_port, relay_port = free_port(HOST), free_port(HOST)
    stand_in = StandIn(args.floor_first_token_s, args.floor_token_gap_s)
    servers = [
        multiprocessing.get_context("spawn").Process(target=serve, args=(port, servicer))
        for port, servicer in ((stand_in_port, stand_in),
                               (relay_port, BareRelay(f"{HOST}:{stand_in_port}")))
    ]  # fmt: skip
    for server in servers:
        server.start()
    try:
        addresses = {"direct": f"{HOST}:{stand_in_port}", "relay": f"{HOST}:{relay_port}"}

        def calls() -> dict[str, Call]:
            return {path: decode_call(address) for path, address in addresses.items()}

        async def ready_then_measure() -> dict[str, Any]:
            for address in addresses.values():
                async with grpc.aio.insecure_channel(address) as channel:
                    await asyncio.wait_for(channel.channel_ready(), 60)
            return await measure(args, calls, words, no_wait)

        return asyncio.run(ready_then_measure())
    finally:
        for server in servers:
            server.terminate()
            server.join()


def print_table(results: dict[str, Any], hop: str) -> None:
    print(f"{'':12} {'path':7} {'TTFT p50':>10} {'p99':>10} {'ITL p50':>10} {'p99':>10}  (ms)")
    for load, by_path in results.items():
        for path in ("direct", hop, "added"):
            row = by_path[path]
            print(f"{load:12} {path:7} {row['ttft_ms']['p50']!s:>10} {row['ttft_ms']['p99']!s:>10}"
                  f" {row['itl_ms']['p50']!s:>10} {row['itl_ms']['p99']!s:>10}")  # fmt: skip


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
        router_address = cluster.router.grpc_address

        def calls() -> dict[str, Call]:
            return {"direct": decode_call(decode.address, prefill.address),
                    "router": router_call(router_address)}  # fmt: skip

        refresh_s = RouterSettings(redis_url=cluster.redis_url).registry_refresh_s  # the default
        results = asyncio.run(
            measure(args, calls, words, lambda: heartbeats_idle(registry, refresh_s))
        )
    finally:
        cluster.stop()
    floor = transport_floor(args, words)
    print_table(results, "router")
    print("transport floor (no model, a bare relay):")
    print_table(floor, "relay")
    loaded, light = results["loaded"]["added"], results["one_stream"]["added"]
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
        "transport_floor": {
            "added_ttft_ms": floor["loaded"]["added"]["ttft_ms"],
            "added_itl_ms": floor["loaded"]["added"]["itl_ms"],
            "one_stream": floor["one_stream"]["added"],
            "first_token_s": args.floor_first_token_s, "token_gap_s": args.floor_token_gap_s,
        },
        "paths": results, "floor_paths": floor, "targets_ms": TARGETS_MS, "met": met,
    }))  # fmt: skip


if __name__ == "__main__":
    main()
