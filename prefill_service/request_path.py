"""The Prefill RPC's rules, apart from gRPC and KV transfer so that the simulator runs them
too: what the first token is sampled with, which prompt blocks are final and leave, and
whether to read a prefix the decode worker holds instead of computing it."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from engine.kv_cache_manager import KVCacheManager
from engine.request import Request
from engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from engine.llm_engine import LLMEngine

# Before a read has been measured: half what the tcp backend moves here (~2 GB/s; NIXL ~4).
PRIOR_KV_BYTES_PER_S = 1e9
# Smaller reads time their round trips (request, grant, ack), not the bandwidth.
MIN_MEASURED_BYTES = 1 << 20


def first_token_params(asked: SamplingParams, num_prior_output_tokens: int) -> SamplingParams:
    """The prefill engine samples only the first token (of sample 0: the decode worker forks
    the others), the one after the output a moved request had already; stop rules are the
    decode's job, but that token obeys min_tokens too (EOS and stop tokens suppressed)."""
    num_through_first = num_prior_output_tokens + 1
    return replace(asked, max_tokens=num_through_first,
                   min_tokens=min(asked.min_tokens, num_through_first), n=1)  # fmt: skip


@dataclass(slots=True)
class Shipment:
    """How much of one request's prompt KV has left for the decode worker."""

    num_skipped_blocks: int  # the decode worker already holds these
    num_sent_blocks: int = 0  # blocks before this index are sent (or skipped)

    def take_final_blocks(self, request: Request, kv: KVCacheManager) -> slice | None:
        """After a step: where in request.block_ids the blocks that became final since the
        last call are, None when none did. A block is final when full, and the last partial
        block once the whole prompt is computed. They are held (kv.hold) so that they outlive
        the request until sent: the caller releases them."""
        computed = min(request.num_computed_tokens, request.num_prompt_tokens)
        if computed == request.num_prompt_tokens:
            num_final = kv.num_blocks_for(computed)
        else:
            num_final = computed // kv.block_size
        start = max(self.num_sent_blocks, self.num_skipped_blocks)
        if num_final <= start:
            return None
        final = slice(start, num_final)
        kv.hold(request.block_ids[final])
        self.num_sent_blocks = num_final
        return final


@dataclass(slots=True)
class FetchCosts:
    """Seconds to move a prefix's KV (measured reads, a prior before any) against seconds to
    compute it (the engine's measured prefill tokens/s)."""

    kv_bytes_per_token: float
    kv_bytes_per_s: float = PRIOR_KV_BYTES_PER_S

    def transfer_s(self, num_tokens: int) -> float:
        return num_tokens * self.kv_bytes_per_token / self.kv_bytes_per_s

    @staticmethod
    def compute_s(num_tokens: int, prefill_tokens_per_s: float) -> float:
        # Not measured yet (no prefill of 64+ tokens ran): computing counts as the slow way.
        return num_tokens / prefill_tokens_per_s if prefill_tokens_per_s > 0 else math.inf

    def record(self, num_bytes: int, seconds: float) -> bool:
        """Takes a read's rate into the estimate; False when it was too small to count."""
        if num_bytes < MIN_MEASURED_BYTES or seconds <= 0:
            return False
        self.kv_bytes_per_s = 0.8 * self.kv_bytes_per_s + 0.2 * num_bytes / seconds
        return True


@dataclass(frozen=True, slots=True)
class FetchPlan:
    """A prefix read from the decode worker: our own hits (referenced) and the blocks reserved
    to fill after them, both held until the request ends; or why it is computed instead."""

    own_ids: list[int] = field(default_factory=list)
    dst_ids: list[int] = field(default_factory=list)
    refused: str | None = None  # "slower" (moving it would take longer) | "no_room"


def plan_prefix_fetch(
    engine: LLMEngine,
    prompt: list[int],
    num_held_blocks: int,
    costs: FetchCosts,
    prefill_tokens_per_s: float,
) -> FetchPlan | None:
    """Engine thread: what to read of the num_held_blocks prompt blocks the decode worker
    holds, past our own prefix hits (our host tier's among them: loading them here is a
    memory copy, reading them a network transfer); None when it holds nothing more. Its walk
    of our prefix is the request's lookup in the tiers' metrics: the request built for this
    prompt is marked (Request.prefix_looked_up) so that its match does not count it again."""
    own_ids = engine.kv.claim_prefix(prompt)
    num_blocks = num_held_blocks - len(own_ids)
    num_tokens = num_blocks * engine.kv.block_size
    plan: FetchPlan | None = None
    if num_blocks > 0:
        if costs.transfer_s(num_tokens) >= costs.compute_s(num_tokens, prefill_tokens_per_s):
            plan = FetchPlan(refused="slower")
        elif (dst_ids := engine.reserve_prefix_fetch(num_blocks)) is None:
            plan = FetchPlan(refused="no_room")
        else:
            return FetchPlan(own_ids, dst_ids)
    engine.kv.release(own_ids)  # still cached: the request's own prefix match finds them
    return plan
