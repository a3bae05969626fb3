"""The host KV tier on a multi-turn chat whose live KV is several pools' worth: tier on vs off.

One engine per mode in this process (the CPU defaults: int4 weights, fp32 KV), the same
workload in both: --conversations chats of --turns turns sharing one --system-tokens system
prompt; each turn appends a --user-tokens user message, and its --max-tokens greedy reply
(ignore_eos) joins the conversation. Conversations return in rounds (every conversation's turn
1, then every turn 2, ...), --concurrency turns in flight at once, so a conversation comes
back after all the others have been served: its KV has long left a pool sized for
--pool-conversations conversations (--num-blocks, default: the shared system prompt plus that
many conversations at their last turn). The tier (--kv-offload-gb, default: room for every
conversation) is host memory. The two modes take turns step by step, each on a clock of its
own that runs only while it steps, so load from other processes on a shared machine falls on
both alike and neither's times count the other's steps.

Per mode: prompt tokens, prefill tokens computed (prompt minus prefix hits), of the hits those
loaded from the host tier, the oracle (prefill tokens if nothing were ever evicted: the bound
for any tier), those the tier held but the engine computed (its loads measured slower), TTFT
p50/p99 (enqueue to first token, on the mode's clock) and its p50 per round, turns/s, the time
of its steps (busy_s) and of those among them that carried a prompt chunk (prefill_step_s: the
share a tier can shrink; decode-only steps it cannot), and the tier's own counts (bytes each
way, load seconds).
The last line of stdout is JSON with the ratios tier / no tier: prefill_tokens_ratio,
ttft_p50_ratio, throughput_ratio, each with its target, and oracle_prefill_tokens_ratio. Run
from the repository root: python -m bench.kv_tier [--quick]. The full workload (128
conversations, a pool of 16) takes 5-6 minutes on a 2-core AVX-512 host;
--quick (32, a pool of 4: the same 8x) about a quarter of that.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from collections import deque
from typing import Any

from bench.serve import percentile, word_ids
from engine import SamplingParams
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.request import Request

QUICK = {"conversations": 32, "pool_conversations": 4}
TARGETS = {"prefill_tokens_ratio": ("<=", 0.35), "ttft_p50_ratio": ("<=", 0.5),
           "throughput_ratio": (">=", 1.5)}  # fmt: skip
BLOCK_SIZE = 16


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--conversations", type=int, default=128)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--system-tokens", type=int, default=400)
    parser.add_argument("--user-tokens", type=int, default=40)
    parser.add_argument("--max-tokens", type=int, default=32, help="reply tokens per turn")
    parser.add_argument("--concurrency", type=int, default=4, help="turns in flight at once")
    parser.add_argument(
        "--pool-conversations",
        type=int,
        default=16,
        help="conversations (at their last turn) the pool holds",
    )
    parser.add_argument("--num-blocks", type=int, default=0, help="0: from --pool-conversations")
    parser.add_argument(
        "--kv-offload-gb", type=float, default=0.0, help="0: room for every conversation"
    )
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--step-overhead-tokens", type=int, default=None,
        help="the engine's step_overhead_tokens (default: the engine's, 16 on a CPU)",
    )  # fmt: skip
    parser.add_argument(
        "--quick",
        action="store_true",
        help=f"{QUICK['conversations']} conversations, a pool of {QUICK['pool_conversations']}",
    )
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()  # fmt: skip
    if args.quick:
        args.conversations = QUICK["conversations"]
        args.pool_conversations = QUICK["pool_conversations"]
    return args


def blocks_per_conversation(args: argparse.Namespace) -> int:
    """A conversation's own KV blocks at its last turn, past the shared system prompt."""
    own_tokens = args.turns * (args.user_tokens + args.max_tokens)
    return -(-own_tokens // BLOCK_SIZE) + 1  # +1: the block that straddles the system prompt


def sizes(args: argparse.Namespace) -> tuple[int, float, int]:
    """(pool blocks, tier GiB, live KV blocks of the whole workload)."""
    system_blocks = -(-args.system_tokens // BLOCK_SIZE)
    own = blocks_per_conversation(args)
    num_blocks = args.num_blocks or system_blocks + args.pool_conversations * own
    live_blocks = system_blocks + args.conversations * own
    block_bytes = BLOCK_SIZE * 46_080  # SmolLM2-135M's fp32 KV
    tier_gb = args.kv_offload_gb or live_blocks * block_bytes * 1.1 / 2**30
    return num_blocks, tier_gb, live_blocks


def workload(args: argparse.Namespace, words: list[int]) -> tuple[list[int], list[list[list[int]]]]:
    """The system prompt and each conversation's user messages, as token ids (plain words)."""
    rng = random.Random(args.seed)
    system = [rng.choice(words) for _ in range(args.system_tokens)]
    users = [[[rng.choice(words) for _ in range(args.user_tokens)] for _ in range(args.turns)]
             for _ in range(args.conversations)]  # fmt: skip
    return system, users


class Mode:
    """One engine and its conversations so far. Its clock runs only while it steps: the two
    modes take turns step by step, so load from other processes on this shared machine falls
    on both alike, and neither's times (TTFT included) count the other's steps."""

    def __init__(self, args, tier_gb: float, num_blocks: int, system: list[int]) -> None:
        self.args = args
        self.busy_s = 0.0  # the time of its steps so far
        self._step_started: float | None = None
        config = EngineConfig(num_threads=args.threads, num_blocks=num_blocks,
                              kv_offload_gb=tier_gb,
                              step_overhead_tokens=args.step_overhead_tokens)  # fmt: skip
        self.engine = LLMEngine(config, clock=self.clock)
        self.params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0,
                                     ignore_eos=True)  # fmt: skip
        # First-run costs (not counted): one prompt the workload never shares. Its steps run on
        # the clock like any other, so the prefill speed the engine measures from them (which
        # decides whether a tier load beats computing) is real.
        self.engine.add_request("warm-up", [7] * (args.system_tokens + args.user_tokens),
                                self.params)  # fmt: skip
        while self.engine.has_unfinished_requests():
            self.timed_step()
        self.engine.kv.reset_cache()
        self.busy_s = 0.0
        self.prefill_step_s = 0.0  # of busy_s, steps that carried a prompt chunk
        self.history = [list(system) for _ in range(args.conversations)]
        self.done: list[Request] = []
        self.pending: deque[int] = deque()
        self.in_flight: dict[int, Request] = {}
        self.turn = 0

    def clock(self) -> float:
        started = self._step_started
        return self.busy_s + (time.monotonic() - started if started is not None else 0.0)

    def timed_step(self) -> float:
        """One engine step, its time added to the clock; returns it."""
        self._step_started = time.monotonic()
        self.engine.step()
        step_s = time.monotonic() - self._step_started
        self._step_started = None
        self.busy_s += step_s
        return step_s

    def start_round(self, turn: int) -> None:
        """Every conversation's turn `turn` is next, --concurrency in flight at once."""
        self.turn, self.pending = turn, deque(range(self.args.conversations))

    @property
    def has_work(self) -> bool:
        return bool(self.pending or self.in_flight)

    def advance(self, users: list[list[list[int]]]) -> None:
        """Admits turns while there is room, then runs one engine step."""
        while self.pending and len(self.in_flight) < self.args.concurrency:
            c = self.pending.popleft()
            self.history[c].extend(users[c][self.turn])
            self.in_flight[c] = self.engine.add_request(
                f"c{c}-t{self.turn}", list(self.history[c]), self.params
            )
        prefills = any(r.num_output_tokens == 0 for r in self.in_flight.values())
        step_s = self.timed_step()
        self.prefill_step_s += step_s if prefills else 0.0
        for c, request in list(self.in_flight.items()):
            if request.is_finished:
                self.history[c].extend(request.output_token_ids)
                self.done.append(request)
                del self.in_flight[c]

    def summary(self) -> dict[str, Any]:
        engine, done = self.engine, self.done
        engine.kv.check_integrity()
        ttfts = [r.first_token_time_s - r.arrival_time_s for r in done]
        num_prompt = sum(r.num_prompt_tokens for r in done)
        num_cached = sum(r.num_cached_tokens for r in done)
        summary = {
            "turns": len(done), "busy_s": round(self.busy_s, 1),
            "prefill_step_s": round(self.prefill_step_s, 1),
            "num_blocks": engine.pool.num_blocks, "prompt_tokens": num_prompt,
            "prefill_tokens": num_prompt - num_cached,
            "oracle_prefill_tokens": oracle_prefill_tokens(done, self.args),
            "host_hit_tokens": engine.kv.stats.num_host_hit_tokens,
            "host_skipped_tokens": engine.kv.stats.num_host_skipped_tokens,
            "preemptions": sum(r.num_preemptions for r in done),
            "ttft_p50_s": round(percentile(ttfts, 50), 4),
            "ttft_p99_s": round(percentile(ttfts, 99), 4),
            "ttft_p50_s_by_turn": ttft_p50_by_turn(done),
            "turns_per_s": round(len(done) / self.busy_s, 4),
        }  # fmt: skip
        if engine.tier is not None:
            stats = engine.tier.stats
            summary |= {
                "tier_gb": round(engine.tier.capacity_bytes / 2**30, 3),
                "tier_stored_mb": round(stats.stored_bytes / 1e6, 1),
                "tier_loaded_mb": round(stats.loaded_bytes / 1e6, 1),
                "tier_load_s": round(stats.load_s, 3),
                "tier_load_gb_per_s": round(stats.loaded_bytes / 1e9 / max(stats.load_s, 1e-9), 2),
                "tier_evicted_blocks": stats.num_evicted_blocks,
            }
        return summary


def ttft_p50_by_turn(done: list[Request]) -> list[float]:
    """TTFT p50 of each round. A round's turns that arrive together are prefilled together
    while their chunks fit one step, each waiting for the whole step; turns whose prompts
    need more steps drift apart and later arrive one by one between other turns' decodes."""
    by_turn: dict[int, list[float]] = {}
    for r in done:
        turn = int(r.request_id.split("-t")[1])
        by_turn.setdefault(turn, []).append(r.first_token_time_s - r.arrival_time_s)
    return [round(percentile(by_turn[t], 50), 4) for t in sorted(by_turn)]


def oracle_prefill_tokens(done: list[Request], args: argparse.Namespace) -> int:
    """Prefill tokens if no cache ever evicted: each turn computes only what its previous turn
    (or, for a first turn, the shared system prompt) left in whole blocks of KV. The bound any
    tier can reach: what is left is new user text and the tail of a partly filled block."""
    kv_tokens: dict[str, int] = {}  # conversation -> tokens of KV its last turn left
    total, first = 0, True
    for request in sorted(done, key=lambda r: int(r.request_id.split("-t")[1])):
        conversation = request.request_id.split("-t")[0]
        reusable = kv_tokens.get(conversation, 0 if first else args.system_tokens)
        first = False
        reusable = min(reusable, request.num_prompt_tokens - 1) // BLOCK_SIZE * BLOCK_SIZE
        total += request.num_prompt_tokens - reusable
        kv_tokens[conversation] = request.num_tokens - 1  # the last token has no KV yet
    return total


def main() -> None:
    args = parse_args()
    started = time.monotonic()
    from engine.model_files import resolve_model
    from engine.tokenizer import TextTokenizer

    words = word_ids(TextTokenizer.load(resolve_model("smollm2-135m")))
    system, users = workload(args, words)
    num_blocks, tier_gb, live_blocks = sizes(args)
    pools = live_blocks / num_blocks
    print(f"pool {num_blocks} blocks; live KV {live_blocks} blocks ({pools:.1f} pools); "
          f"tier {tier_gb:.2f} GiB", flush=True)  # fmt: skip
    modes = {"no_tier": Mode(args, 0.0, num_blocks, system),
             "tier": Mode(args, tier_gb, num_blocks, system)}  # fmt: skip
    for turn in range(args.turns):
        for mode in modes.values():
            mode.start_round(turn)
        while any(mode.has_work for mode in modes.values()):
            for mode in modes.values():
                if mode.has_work:
                    mode.advance(users)
    results = {name: mode.summary() for name, mode in modes.items()}
    for name, summary in results.items():
        print(name, json.dumps(summary), flush=True)
    on, off = results["tier"], results["no_tier"]
    oracle = on["oracle_prefill_tokens"]
    replies = [{r.request_id: r.output_token_ids for r in m.done} for m in modes.values()]
    same = sum(replies[1][k] == v for k, v in replies[0].items())
    ratios = {
        "prefill_tokens_ratio": round(on["prefill_tokens"] / off["prefill_tokens"], 4),
        "ttft_p50_ratio": round(on["ttft_p50_s"] / off["ttft_p50_s"], 4),
        "throughput_ratio": round(on["turns_per_s"] / off["turns_per_s"], 4),
    }
    targets = {
        name: {"value": value, "target": f"{TARGETS[name][0]} {TARGETS[name][1]}",
               "met": value <= TARGETS[name][1] if TARGETS[name][0] == "<=" else
               value >= TARGETS[name][1]}
        for name, value in ratios.items()
    }  # fmt: skip
    setup = {k: getattr(args, k) for k in ("conversations", "turns", "system_tokens",
             "user_tokens", "max_tokens", "concurrency", "pool_conversations")}  # fmt: skip
    if args.step_overhead_tokens is not None:  # not the engine's default
        setup["step_overhead_tokens"] = args.step_overhead_tokens
    print(json.dumps({
        **ratios, "targets": targets, "replies_identical": f"{same}/{len(replies[0])}",
        "oracle_prefill_tokens_ratio": round(oracle / off["prefill_tokens"], 4),
        "live_kv_pools": round(live_blocks / num_blocks, 1), "setup": setup,
        "wall_s": round(time.monotonic() - started, 1),
    }))  # fmt: skip


if __name__ == "__main__":
    main()
