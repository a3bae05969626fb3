"""Block pool bookkeeping: reference counts, prefix-cache map, LRU eviction order."""

from __future__ import annotations

import pytest

from engine.block_pool import BlockPool, NoFreeBlocksError
from engine.kv_cache_manager import KVCacheManager
from engine.prefix_hash import (
    PromptBlockHashes,
    extend_block_hashes,
    hash_block,
    prompt_block_hashes,
)
from tests.engine.kv_state import cached_in_pool


def cached_pool(num_blocks: int, cached_ids: list[int]) -> BlockPool:
    """A pool whose blocks `cached_ids` were used, hashed and freed in that order."""
    pool = BlockPool(num_blocks)
    block_ids = pool.allocate(len(cached_ids))
    assert block_ids == list(range(len(cached_ids)))
    for block_id in block_ids:
        pool.cache(block_id, hash_block(None, [block_id]))
    pool.free(cached_ids)
    return pool


def test_allocation_takes_empty_blocks_before_evicting_cached_ones():
    pool = cached_pool(6, [0, 1, 2])
    assert pool.allocate(3) == [3, 4, 5]
    assert len(pool.hash_to_block) == 3
    pool.check_integrity()


def test_cached_blocks_are_evicted_least_recently_freed_first():
    pool = cached_pool(4, [2, 0, 1])  # freed in order 2, 0, 1
    assert pool.allocate(1) == [3]  # the empty block goes first
    assert pool.allocate(2) == [2, 0]
    assert pool.lookup(hash_block(None, [2])) is None
    assert pool.lookup(hash_block(None, [0])) is None
    assert pool.lookup(hash_block(None, [1])) == 1
    pool.check_integrity()


def test_a_cache_hit_refreshes_recency():
    pool = cached_pool(3, [0, 1, 2])
    pool.touch([0])  # hit: block 0 is in use again
    pool.free([0])  # and now the most recently freed
    assert pool.allocate(3) == [1, 2, 0]


def test_shared_blocks_are_freed_only_by_their_last_owner():
    pool = BlockPool(4)
    [block_id] = pool.allocate(1)
    pool.cache(block_id, hash_block(None, [7]))
    pool.touch([block_id])
    assert pool.blocks[block_id].ref_cnt == 2
    pool.free([block_id])
    assert pool.num_free_blocks == 3
    pool.free([block_id])
    assert pool.num_free_blocks == 4
    assert list(pool.cached_free) == [block_id]
    pool.check_integrity()


def test_allocating_more_than_free_raises_and_takes_nothing():
    pool = BlockPool(2)
    pool.allocate(1)
    with pytest.raises(NoFreeBlocksError, match="asked for 2 KV blocks, only 1 free"):
        pool.allocate(2)
    assert pool.num_free_blocks == 1


def test_check_integrity_reports_the_numbers():
    pool = BlockPool(3)
    pool.allocate(1)
    pool.blocks[0].ref_cnt = 0  # a leak the pool did not see
    with pytest.raises(AssertionError, match=r"0 in use \+ 2 free != 3 blocks"):
        pool.check_integrity()


def test_hash_chain_depends_on_every_earlier_block():
    first = hash_block(None, [1, 2])
    assert hash_block(first, [3, 4]) != hash_block(hash_block(None, [9, 9]), [3, 4])
    assert hash_block(first, [3, 4]) == hash_block(hash_block(None, [1, 2]), [3, 4])


def test_cache_changes_are_recorded_only_when_asked_in_order():
    pool = cached_pool(3, [0, 1])
    assert pool.take_cache_events() == []  # off by default: nothing piles up
    pool.record_events = True
    [block_id] = pool.allocate(1)  # the empty block: no eviction
    pool.cache(block_id, hash_block(None, [9]))
    pool.cache(block_id, hash_block(None, [9]))  # already cached: no second event
    pool.allocate(1)  # evicts block 0, least recently freed
    pool.free([block_id])
    assert pool.reset_cache() == 2
    assert pool.take_cache_events() == [
        (True, hash_block(None, [9])),
        (False, hash_block(None, [0])),
        (False, hash_block(None, [1])),
        (False, hash_block(None, [9])),
    ]
    assert pool.take_cache_events() == []


def test_block_hashes_extend_the_chain_block_by_block():
    tokens = list(range(40))
    hashes: list[bytes] = []
    extend_block_hashes(hashes, tokens[:20], 16)
    assert hashes == [hash_block(None, tokens[:16])]
    extend_block_hashes(hashes, tokens, 16)
    assert hashes == [hash_block(None, tokens[:16]), hash_block(hashes[0], tokens[16:32])]
    # The router hashes only blocks a cache can serve: never the one holding the last token.
    assert prompt_block_hashes(tokens[:32], 16) == (hashes[0],)
    assert prompt_block_hashes(tokens[:33], 16) == tuple(hashes)


def test_blocks_a_peer_filled_are_found_by_the_prefix_match_after_our_own():
    kv = KVCacheManager(BlockPool(8), block_size=4)
    prompt = list(range(100, 114))  # 14 tokens: 3 full blocks end before the last token
    hashes = prompt_block_hashes(prompt, 4)
    [own] = kv.pool.allocate(1)  # computed here, then freed: cached-free
    kv.pool.cache(own, hashes[0])
    kv.pool.free([own])
    assert cached_in_pool(kv, prompt) == [0]
    filled = kv.pool.allocate(2)  # what a peer fetch reads into
    kv.cache_prompt_blocks(prompt, 1, filled)
    assert cached_in_pool(kv, prompt) == [0, 1, 2]
    kv.pool.free(filled)
    kv.pool.check_integrity()


def test_prompt_block_hashes_read_lazily_equal_the_eager_ones():
    prompt = list(range(1000, 1000 + 16 * 9 + 5))
    eager = prompt_block_hashes(prompt, 16)
    lazy = PromptBlockHashes(prompt, 16)
    assert len(lazy) == len(eager) == 9
    assert lazy[0] == eager[0] and lazy._hashes == [eager[0]]  # one read, one hash
    assert lazy[-1] == eager[-1] and tuple(lazy) == eager and lazy[2:4] == eager[2:4]
    assert list(PromptBlockHashes(prompt[:16], 16)) == []  # a lone block ends at the last token
    with pytest.raises(IndexError):
        lazy[9]
