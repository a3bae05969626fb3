"""The Prefill RPC's rules, apart from gRPC and KV transfer so that the simulator runs them
too: what the first token is sampled with, and which prompt blocks are final and leave."""

from __future__ import annotations

from dataclasses import dataclass, replace

from engine.kv_cache_manager import KVCacheManager
from engine.request import Request
from engine.sampling_params import SamplingParams


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
