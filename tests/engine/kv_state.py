"""What a test reads of a KV cache manager's state, changing nothing."""

from __future__ import annotations

from collections.abc import Sequence

from engine.kv_cache_manager import KVCacheManager
from engine.prefix_hash import prompt_block_hashes


def cached_blocks(kv: KVCacheManager, block_hashes: Sequence[bytes]) -> list[int]:
    """The pool's blocks cached under the leading hashes, up to the first it lacks (no
    reference taken, nothing loaded from a host tier)."""
    block_ids = []
    for block_hash in block_hashes:
        block_id = kv.pool.lookup(block_hash)
        if block_id is None:
            break
        block_ids.append(block_id)
    return block_ids


def cached_in_pool(kv: KVCacheManager, prompt: list[int]) -> list[int]:
    """The pool's part of what a prefix match of the prompt would hit."""
    return cached_blocks(kv, prompt_block_hashes(prompt, kv.block_size))
