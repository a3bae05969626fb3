"""KV-aware routing vs load-only routing on a multi-turn chat workload.

`pdserve up --prefill 2 --decode 2` (the same launcher, a fresh cluster per mode so neither
inherits the other's caches), one router per mode:
  load_only  the watermark policy with both prefix weights 0, workers with --no-peer-fetch
  kv_aware   the watermark policy with its default prefix weights, workers with peer fetch
             (a prefill worker reads the prefix its decode worker holds, replies included)
The workload, identical in both modes: --conversations chats of --turns turns through
/v1/chat/completions (streaming, greedy, ignore_eos), all sharing one --system-tokens system
prompt; every turn appends a --user-tokens user message and the --max-tokens reply to the
conversation. --concurrency clients each run one conversation at a time, turn after turn.

Per mode: prefix hit rate (cached prompt tokens / prompt tokens, as usage reports the prefill
worker's hits and what it read from the decode worker), prefill tokens computed (prompt minus
cached), of them read from a peer (the prefill workers' metrics), TTFT p50/p99 (client side),
and what the prefix-cache events cost Redis (entries, events, bytes). Also a bound no router
can beat without moving KV between workers: `oracle_prefill_tokens`, each turn computing only
what its conversation's previous turn (or the shared system prompt) did not already cover,
in whole blocks, as if no cache ever evicted. The last line of stdout
is JSON with the ratios kv_aware / load_only: prefill_tokens_ratio, ttft_p50_ratio,
ttft_p99_ratio. Run from the repository root: python -m bench.prefix [--quick].
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from typing import Any

import httpx
import redis
from prometheus_client.parser import text_string_to_metric_families

from bench.serve import percentile, word_ids
from engine.model_files import resolve_model
from engine.tokenizer import TextTokenizer
from pdserve.kv_events import STREAM_PREFIX, CacheUpdate
from pdserve.launcher import ClusterSpec, LocalCluster
from pdserve.registry import Registry

MODES = {  # (router flags, worker flags)
    "load_only": (("--prefix-prefill-weight", "0", "--prefix-decode-weight", "0"),
                  ("--no-peer-fetch",)),
    "kv_aware": ((), ()),
}  # fmt: skip
QUICK = {"conversations": 8, "turns": 4}
BLOCK_SIZE = 16  # the workers' KV block: the unit a prefix cache serves

Messages = list[dict[str, str]]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--conversations", type=int, default=32)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--system-tokens", type=int, default=400)
    parser.add_argument("--user-tokens", type=int, default=40)
    parser.add_argument("--max-tokens", type=int, default=32, help="reply tokens per turn")
    parser.add_argument("--concurrency", type=int, default=8, help="conversations at once")
    parser.add_argument(
        "--quick",
        action="store_true",
        help=f"{QUICK['conversations']} conversations x {QUICK['turns']} turns",
    )
    parser.add_argument("--cores", type=int, default=0, help="0 = all; split among workers")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()  # fmt: skip
    if args.quick:
        args.conversations, args.turns = QUICK["conversations"], QUICK["turns"]
    return args


def workload(args: argparse.Namespace, words: list[str]) -> tuple[str, list[list[str]]]:
    """The system prompt and each conversation's user messages (one plain word a token)."""
    rng = random.Random(args.seed)

    def text(n: int) -> str:
        return "".join(rng.choice(words) for _ in range(n))

    system = text(args.system_tokens)
    users = [[text(args.user_tokens) for _ in range(args.turns)]
             for _ in range(args.conversations)]  # fmt: skip
    return system, users


async def turn(client: httpx.AsyncClient, url: str, messages: Messages, max_tokens: int):
    """One streamed chat turn: (reply text, TTFT seconds, prompt tokens, cached tokens)."""
    body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
    started = time.monotonic()
    ttft_s, pieces, usage = None, [], None
    async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"{response.status_code}: {(await response.aread()).decode()}")
        async for line in response.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[len("data: ") :])
            if chunk.get("usage"):
                usage = chunk["usage"]
            for choice in chunk.get("choices", []):
                content = choice.get("delta", {}).get("content")
                if content:
                    ttft_s = ttft_s if ttft_s is not None else time.monotonic() - started
                    pieces.append(content)
    assert usage is not None and ttft_s is not None, "no usage or no token in the stream"
    cached = usage["prompt_tokens_details"]["cached_tokens"]
    return "".join(pieces), ttft_s, usage["prompt_tokens"], cached


def oracle_tokens(tokenizer: TextTokenizer, system: str, users: list[list[str]],
                  replies: dict[tuple[int, int], str]) -> int:  # fmt: skip
    """Prefill tokens if each turn found its longest reusable prefix cached: the previous
    turn's prompt, or the first conversation's first prompt (the shared system prompt)."""
    first: list[int] | None = None
    total = 0
    for c, conversation in enumerate(users):
        messages: Messages = [{"role": "system", "content": system}]
        previous: list[int] = []
        for t, user in enumerate(conversation):
            messages.append({"role": "user", "content": user})
            ids = tokenizer.encode(tokenizer.apply_chat_template(messages))
            shared = _common_prefix(ids, previous)
            if first is None:
                first = ids
            else:
                shared = max(shared, _common_prefix(ids, first))
            total += len(ids) - min(shared, len(ids) - 1) // BLOCK_SIZE * BLOCK_SIZE
            messages.append({"role": "assistant", "content": replies[c, t]})
            previous = ids
    return total


def _common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y),
                min(len(a), len(b)))  # fmt: skip


async def run_conversations(url: str, system: str, users: list[list[str]], args) -> list[dict]:
    pending = iter(enumerate(users))
    results: list[dict] = []

    async def client_loop(client: httpx.AsyncClient) -> None:
        for c, conversation in pending:
            messages: Messages = [{"role": "system", "content": system}]
            for i, user in enumerate(conversation):
                messages.append({"role": "user", "content": user})
                reply, ttft_s, num_prompt, num_cached = await turn(
                    client, url, messages, args.max_tokens
                )
                messages.append({"role": "assistant", "content": reply})
                results.append({"conversation": c, "turn": i, "ttft_s": ttft_s,
                                "reply": reply, "prompt_tokens": num_prompt,
                                "cached_tokens": num_cached})  # fmt: skip

    limits = httpx.Limits(max_connections=args.concurrency + 2)
    async with httpx.AsyncClient(timeout=1800, limits=limits) as client:
        await asyncio.gather(*(client_loop(client) for _ in range(args.concurrency)))
    return results


def event_costs(redis_url: str, num_requests: int) -> dict[str, Any]:
    """What the workers' prefix-cache streams hold: entries, block events (delta hashes),
    Redis memory and payload bytes, per event and per request."""
    client = redis.Redis.from_url(redis_url)
    entries = num_events = num_snapshot_hashes = payload_bytes = memory_bytes = 0
    for key in client.scan_iter(match=f"{STREAM_PREFIX}:*"):
        memory_bytes += client.memory_usage(key, samples=0) or 0
        for _, fields in client.xrange(key):
            update = CacheUpdate.from_fields(fields)
            entries += 1
            payload_bytes += sum(len(k) + len(v) for k, v in fields.items())
            if update.is_snapshot:
                num_snapshot_hashes += len(update.stored)
            else:
                num_events += update.num_events
    per_event = max(1, num_events)
    return {
        "stream_entries": entries,
        "block_events": num_events,
        "snapshot_hashes": num_snapshot_hashes,
        "redis_memory_bytes": memory_bytes,
        "payload_bytes": payload_bytes,
        "redis_bytes_per_event": round(memory_bytes / per_event, 1),
        "payload_bytes_per_event": round(payload_bytes / per_event, 1),
        "events_per_request": round(num_events / max(1, num_requests), 2),
        "entries_per_request": round(entries / max(1, num_requests), 2),
    }


def peer_fetched_tokens(redis_url: str) -> int:
    """Prompt tokens the prefill workers read from decode workers so far (their metrics)."""
    total = 0.0
    for worker in Registry(redis_url).workers("prefill"):
        text = httpx.get(worker.metrics_url, timeout=10).text
        for family in text_string_to_metric_families(text):
            total += sum(s.value for s in family.samples
                         if s.name == "pdserve_prefill_prompt_tokens_total"
                         and s.labels.get("source") == "peer_fetch")  # fmt: skip
    return int(total)


def summarize(results: list[dict], wall_s: float) -> dict[str, Any]:
    ttfts = [r["ttft_s"] for r in results]
    num_prompt = sum(r["prompt_tokens"] for r in results)
    num_cached = sum(r["cached_tokens"] for r in results)
    later = [r["ttft_s"] for r in results if r["turn"] > 0]
    return {
        "requests": len(results),
        "wall_s": round(wall_s, 1),
        "prompt_tokens": num_prompt,
        "prefix_hit_rate": round(num_cached / max(1, num_prompt), 4),
        "prefill_tokens_computed": num_prompt - num_cached,
        "ttft_p50_s": _round(percentile(ttfts, 50)),
        "ttft_p99_s": _round(percentile(ttfts, 99)),
        "ttft_p50_later_turns_s": _round(percentile(later, 50)),
        "replies": {(r["conversation"], r["turn"]): r["reply"] for r in results},
    }


def run_mode(mode: str, args, system: str, users: list[list[str]]) -> dict[str, Any]:
    router_args, worker_args = MODES[mode]
    spec = ClusterSpec(num_prefill=2, num_decode=2, kv_backend="tcp", num_cores=args.cores,
                       warmup=False, with_router=False, worker_args=worker_args)  # fmt: skip
    cluster = LocalCluster(spec).start()
    try:
        router = cluster.add_router(f"router-{mode}", (*router_args, "--log-level", "warning"))
        # First-run costs (not measured): one short chat per worker pair, nothing shared.
        warm = [[f" warm{i}"] for i in range(4)]
        asyncio.run(run_conversations(router.http_url, " hello", warm, args))
        fetched_before = peer_fetched_tokens(cluster.redis_url)
        started = time.monotonic()
        results = asyncio.run(run_conversations(router.http_url, system, users, args))
        summary = summarize(results, time.monotonic() - started)
        summary["peer_fetched_tokens"] = peer_fetched_tokens(cluster.redis_url) - fetched_before
        summary["redis"] = event_costs(cluster.redis_url, len(results) + len(warm))
        print(mode, json.dumps({k: v for k, v in summary.items() if k != "replies"}), flush=True)
        return summary
    finally:
        cluster.stop()


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 4)


def _ratio(results: dict[str, dict], key: str) -> float | None:
    base = results["load_only"][key]
    return _round(results["kv_aware"][key] / base) if base else None


def main() -> None:
    args = parse_args()
    started = time.monotonic()
    tokenizer = TextTokenizer.load(resolve_model("smollm2-135m"))
    words = [tokenizer.decode([i]) for i in word_ids(tokenizer)]
    system, users = workload(args, words)
    results = {mode: run_mode(mode, args, system, users) for mode in MODES}
    replies = results["kv_aware"].pop("replies")  # greedy: the same in both modes
    results["load_only"].pop("replies")
    oracle = oracle_tokens(tokenizer, system, users, replies)
    load_only_tokens = results["load_only"]["prefill_tokens_computed"]
    print(f"({time.monotonic() - started:.0f} s)")
    print(json.dumps({
        "config": vars(args), **results, "oracle_prefill_tokens": oracle,
        "oracle_prefill_tokens_ratio": _round(oracle / load_only_tokens),
        "prefill_tokens_ratio": _ratio(results, "prefill_tokens_computed"),
        "ttft_p50_ratio": _ratio(results, "ttft_p50_s"),
        "ttft_p99_ratio": _ratio(results, "ttft_p99_s"),
    }), flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
