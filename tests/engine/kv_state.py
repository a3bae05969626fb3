"""What a test reads of a KV cache manager's state, changing nothing."""

from __future__ import annotations

from engine.kv_cache_manager import KVCacheManager
from engine.prefix_hash import prompt_block_hashes


def cached_in_pool(kv: KVCacheManager, prompt: list[int]) -> list[int]:
    """The pool's cached blocks that start the prompt: the pool's part of what a prefix match
    would hit (no reference taken, nothing loaded from a host tier)."""
    block_ids = []
    for block_hash in prompt_block_hashes(prompt, kv.block_size):
        block_id = kv.pool.lookup(block_hash)
        if block_id is None:
            break
        block_ids.append(block_id)
    return block_ids
