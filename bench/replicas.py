"""Two router replicas on real processes: `pdserve up --routers 2 --prefill 2 --decode 2`.

  burst      --burst long prompts (--prompt-tokens random words each, --max-tokens output) sent
             at once, split over both routers, and then the same burst through one router.
             While each runs, both prefill workers' pdserve_prefill_queued_tokens is polled
             every 20 ms: its peak against the bound the replicas promise (the router's
             prefill token budget plus one request per router sending work). Decode refusals
             are summed from the routers' pdserve_router_decode_refusals_total.
  restart    steady load (Poisson, --rate req/s for --duration-s, short prompts) through both
             routers while Redis is killed and restarted by the launcher: every status counted
             (the goal: no 503).
The last line of stdout is one JSON object: per burst the peaks, the bound, refusals and
completions; for the restart the status counts. Run from the repository root:
python -m bench.replicas.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import signal
import threading
import time
from collections import Counter
from typing import Any

from bench.overload import new_client, poisson_arrivals, send
from bench.serve import word_ids
from engine.model_files import resolve_model
from engine.tokenizer import TextTokenizer
from pdserve.launcher import ClusterSpec, LocalCluster, RouterEndpoint
from pdserve.registry import Registry
from planner.local import scrape
from router.settings import AdmissionSettings

BUDGET = AdmissionSettings().prefill_token_budget


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--burst", type=int, default=48)
    parser.add_argument("--prompt-tokens", type=int, default=1024)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--rate", type=float, default=5.0, help="req/s during the restart")
    parser.add_argument("--duration-s", type=float, default=60.0)
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args()


def metric_sum(metrics_url: str, name: str) -> float:
    """A metric's samples of that name summed over their labels (0 before any exists)."""
    return scrape(metrics_url, {name})[name]


def refusals(routers: list[RouterEndpoint]) -> float:
    return sum(metric_sum(f"{r.http_url}/metrics", "pdserve_router_decode_refusals_total")
               for r in routers)  # fmt: skip


def reason(outcome: dict) -> str:
    """A refused request's error code, from its OpenAI-style body (what it says first)."""
    try:
        return str(json.loads(outcome.get("error", ""))["error"]["code"])
    except (ValueError, KeyError, TypeError):
        return outcome.get("error", "")[:80]


class QueuePeaks:
    """The highest pdserve_prefill_queued_tokens each prefill worker showed while running."""

    def __init__(self, metrics_urls: dict[str, str]) -> None:
        self.urls = metrics_urls
        self.peaks = dict.fromkeys(metrics_urls, 0.0)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def __enter__(self) -> QueuePeaks:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _poll(self) -> None:
        while not self._stop.wait(0.02):
            for worker, url in self.urls.items():
                value = metric_sum(url, "pdserve_prefill_queued_tokens")
                self.peaks[worker] = max(self.peaks[worker], value)


async def burst(routers: list[RouterEndpoint], prompts: list[list[int]], max_tokens: int) -> list:
    async with new_client(len(prompts) + 2) as client:
        return await asyncio.gather(*(
            send(client, routers[i % len(routers)].http_url, prompt, max_tokens)
            for i, prompt in enumerate(prompts)
        ))  # fmt: skip


def run_burst(cluster: LocalCluster, routers: list[RouterEndpoint], prompts: list[list[int]],
              args: argparse.Namespace) -> dict[str, Any]:  # fmt: skip
    prefill = {w.worker_id: w.metrics_url for w in Registry(cluster.redis_url).workers("prefill")}
    before = refusals(cluster.routers)
    with QueuePeaks(prefill) as peaks:
        outcomes = asyncio.run(burst(routers, prompts, args.max_tokens))
    bound = BUDGET + len(routers) * args.prompt_tokens
    return {
        "routers": len(routers),
        "completed": sum(o["status"] == 200 and bool(o.get("done")) for o in outcomes),
        "statuses": dict(Counter(str(o["status"]) for o in outcomes)),
        "rejections": dict(Counter(reason(o) for o in outcomes if o["status"] != 200)),
        "peak_queued_tokens": peaks.peaks,
        "bound_tokens": bound,
        "within_bound": all(peak <= bound for peak in peaks.peaks.values()),
        "decode_refusals": refusals(cluster.routers) - before,
    }


def run_restart(cluster: LocalCluster, words: list[int], args: argparse.Namespace) -> dict:
    rng = random.Random(args.seed + 1)
    arrivals = poisson_arrivals(args.rate, args.duration_s, rng)
    prompts = [rng.sample(words, 16) for _ in arrivals]

    def kill_redis() -> None:  # a third of the way in; the launcher restarts it
        time.sleep(args.duration_s / 3)
        cluster.signal_child("redis", signal.SIGKILL)

    async def load() -> list[dict]:
        async with new_client(len(prompts) + 2) as client:
            start_s, tasks = time.monotonic(), []
            for i, (prompt, at_s) in enumerate(zip(prompts, arrivals, strict=True)):
                await asyncio.sleep(max(0.0, start_s + at_s - time.monotonic()))
                url = cluster.routers[i % len(cluster.routers)].http_url
                tasks.append(asyncio.create_task(send(client, url, prompt, args.max_tokens)))
            return list(await asyncio.gather(*tasks))

    killer = threading.Thread(target=kill_redis, daemon=True)
    killer.start()
    outcomes = asyncio.run(load())
    killer.join()
    return {
        "requests": len(outcomes),
        "statuses": dict(Counter(str(o["status"]) for o in outcomes)),
        "responses_503": sum(o["status"] == 503 for o in outcomes),
        "redis_restarts": cluster.redis_restarts.num_restarts,
    }


def main() -> None:
    args = parse_args()
    words = word_ids(TextTokenizer.load(resolve_model("smollm2-135m")))
    rng = random.Random(args.seed)

    def prompts() -> list[list[int]]:  # every prompt its own words: no prefix cache hits
        return [[rng.choice(words) for _ in range(args.prompt_tokens)] for _ in range(args.burst)]

    spec = ClusterSpec(num_prefill=2, num_decode=2, num_routers=2, http_port=0, grpc_port=0)
    cluster = LocalCluster(spec).start()
    reports: list[str] = []
    cluster.watch(reports.append)
    try:
        results = {
            "two_routers": run_burst(cluster, cluster.routers, prompts(), args),
            "one_router": run_burst(cluster, cluster.routers[:1], prompts(), args),
            "redis_restart": run_restart(cluster, words, args),
        }
    finally:
        cluster.stop()
    for name in ("two_routers", "one_router"):
        r = results[name]
        print(f"{name:12} completed {r['completed']}/{args.burst}  peaks {r['peak_queued_tokens']}"
              f"  bound {r['bound_tokens']}  refusals {r['decode_refusals']:.0f}")  # fmt: skip
    print(f"redis restart: {results['redis_restart']}")
    two, one = results["two_routers"], results["one_router"]
    results["met"] = {
        "within_bound": two["within_bound"],
        "refusals_not_above_one_router": two["decode_refusals"] <= one["decode_refusals"],
        "no_503_through_redis_restart": results["redis_restart"]["responses_503"] == 0,
    }
    results["supervisor"] = reports
    print(json.dumps(results))


if __name__ == "__main__":
    main()
