"""The SLA planner on real processes: `pdserve up --planner` (the local connector) from 1P+1D,
at most --max-workers workers in all, through a load step and back.

Phases of Poisson arrivals through the router (streaming completions of random words, greedy,
--max-tokens each with ignore_eos): quiet (--quiet-rps for --quiet-s), busy (--busy-rps of
--busy-prompt-tokens prompts for --busy-s), quiet again (--after-s). The planner decides every
--interval-s. Reported: each decision (observed and predicted load, desired and actual
replicas), when the planner first asked for a second prefill worker (in intervals after the
busy phase began), TTFT p50 of the busy phase before and after that worker registered, when a
worker was drained away after the load fell, and every request's outcome (complete: 200 with
--max-tokens tokens and finish_reason "length"). The last line of stdout is one JSON object.
Run from the repository root: python -m bench.planner_local.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
from collections import Counter
from typing import Any

from bench.overload import new_client, poisson_arrivals
from bench.serve import word_ids
from engine import EngineConfig
from engine.model_files import resolve_model
from engine.tokenizer import TextTokenizer
from pdserve.launcher import ClusterSpec, LocalCluster
from pdserve.registry import Registry
from planner import local
from planner.settings import PlannerSettings
from sim.costs import LocalCoefficients, LocalCost
from sim.planner_study import profile_of


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--interval-s", type=float, default=15.0)
    parser.add_argument("--max-workers", type=int, default=3)
    parser.add_argument("--quiet-rps", type=float, default=0.2)
    parser.add_argument("--quiet-s", type=float, default=45.0)
    parser.add_argument("--busy-rps", type=float, default=0.5)
    parser.add_argument("--busy-prompt-tokens", type=int, default=512)
    parser.add_argument("--busy-s", type=float, default=120.0)
    parser.add_argument("--after-s", type=float, default=150.0)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args()


async def send(client, url: str, prompt: list[int], max_tokens: int, phase: str) -> dict:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
    outcome: dict[str, Any] = {"phase": phase, "sent_s": time.monotonic(), "tokens": 0}
    async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
        outcome["status"] = response.status_code
        async for line in response.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            for choice in chunk.get("choices", []):
                if choice.get("text") and "ttft_s" not in outcome:
                    outcome["ttft_s"] = time.monotonic() - outcome["sent_s"]
                if choice.get("finish_reason"):
                    outcome["finish_reason"] = choice["finish_reason"]
            if chunk.get("usage"):
                outcome["tokens"] = chunk["usage"]["completion_tokens"]
    return outcome


def main() -> None:
    args = parse_args()
    words = word_ids(TextTokenizer.load(resolve_model("smollm2-135m")))
    rng = random.Random(args.seed)
    settings = PlannerSettings(
        interval_s=args.interval_s, gpu_budget=args.max_workers, min_prefill=1, min_decode=1,
        max_prefill=args.max_workers - 1, max_decode=args.max_workers - 1,
        scale_down_cooldown_s=2 * args.interval_s,
    )  # fmt: skip
    profile = profile_of(LocalCost(LocalCoefficients.load()), EngineConfig().chunk_size)
    cluster = LocalCluster(ClusterSpec(http_port=0, grpc_port=0)).start()
    reports: list[str] = []
    cluster.watch(reports.append)
    events: list[tuple[float, str]] = []
    try:
        planner = local.start(cluster, settings, profile)
        start_s = time.monotonic()
        phases = [("quiet", args.quiet_rps, 16, args.quiet_s),
                  ("busy", args.busy_rps, args.busy_prompt_tokens, args.busy_s),
                  ("after", args.quiet_rps, 16, args.after_s)]  # fmt: skip
        registry = Registry(cluster.redis_url)

        async def watch_pools() -> None:
            last: tuple[int, int] | None = None
            while True:
                pools = (len(registry.workers("prefill")), len(registry.workers("decode")))
                if pools != last:
                    events.append((time.monotonic() - start_s, f"registered {pools}"))
                    last = pools
                await asyncio.sleep(0.5)

        async def load() -> list[dict]:
            watcher = asyncio.create_task(watch_pools())
            tasks, offset_s = [], 0.0
            async with new_client(512) as client:
                for name, rps, prompt_tokens, duration_s in phases:
                    events.append((offset_s, f"phase {name}"))
                    for at_s in poisson_arrivals(rps, duration_s, rng):
                        due = start_s + offset_s + at_s
                        await asyncio.sleep(max(0.0, due - time.monotonic()))
                        prompt = [rng.choice(words) for _ in range(prompt_tokens)]
                        url = cluster.routers[0].http_url
                        tasks.append(asyncio.create_task(
                            send(client, url, prompt, args.max_tokens, name)))  # fmt: skip
                    offset_s += duration_s
                outcomes = await asyncio.gather(*tasks)
            watcher.cancel()
            return list(outcomes)

        outcomes = asyncio.run(load())
        decisions = [d.as_dict() for d in planner.decisions]
    finally:
        cluster.stop()
    for o in outcomes:
        o["at_s"] = o.pop("sent_s") - start_s
    complete = [o for o in outcomes if o["status"] == 200 and o["tokens"] == args.max_tokens
                and o.get("finish_reason") == "length"]  # fmt: skip
    busy_start_s = args.quiet_s
    second_prefill_s = next((t for t, e in events if e.startswith("registered (2")), None)
    asked_s = next((d["time_s"] - start_s for d in decisions
                    if d["desired"]["prefill"] > d["actual"]["prefill"]), None)  # fmt: skip

    def ttft_p50(rows: list[dict]) -> float | None:
        values = [o["ttft_s"] for o in rows if "ttft_s" in o]
        return round(statistics.median(values), 3) if values else None

    busy = [o for o in outcomes if o["phase"] == "busy"]
    after_busy = None if asked_s is None else round(asked_s - busy_start_s, 1)
    result = {
        "requests": len(outcomes), "complete": len(complete),
        "statuses": dict(Counter(str(o["status"]) for o in outcomes)),
        "failed_or_truncated": len(outcomes) - len(complete),
        "asked_for_prefill_s_after_busy": after_busy,
        "asked_within_intervals": None if after_busy is None
        else round(after_busy / args.interval_s, 2),
        "second_prefill_registered_s": second_prefill_s,
        "busy_ttft_p50_before_s": ttft_p50([o for o in busy if second_prefill_s is None
                                            or o["at_s"] < second_prefill_s]),
        "busy_ttft_p50_after_s": ttft_p50([o for o in busy if second_prefill_s is not None
                                           and o["at_s"] >= second_prefill_s]),
        "pool_events": events, "decisions": decisions, "supervisor": reports,
        "settings": settings.model_dump(include={"interval_s", "gpu_budget", "predictor",
                                                 "scale_down_cooldown_s"}),
    }  # fmt: skip
    for t, e in events:
        print(f"{t:7.1f} s  {e}")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
