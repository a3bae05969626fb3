"""The KV cache manager's references outside request block tables (held sends, prefix fetches),
its quarantine of blocks an unfenced writer may reach, and the integrity check over both."""

from __future__ import annotations

import pytest
from prometheus_client import REGISTRY

from engine.block_pool import BlockPool, NoFreeBlocksError
from engine.errors import InsufficientKVError
from engine.kv_cache_manager import KVCacheManager
from engine.prefix_hash import prompt_block_hashes
from engine.request import Request
from engine.sampling_params import SamplingParams
from engine.tokenizer import IncrementalDetokenizer
from tests.engine.kv_state import cached_blocks, cached_in_pool

BLOCK_SIZE = 4


def manager(num_blocks: int) -> KVCacheManager:
    return KVCacheManager(BlockPool(num_blocks), BLOCK_SIZE)


def new_request(prompt: list[int]) -> Request:
    return Request(
        request_id="r",
        token_ids=list(prompt),
        num_prompt_tokens=len(prompt),
        params=SamplingParams(),
        generator=None,
        detokenizer=IncrementalDetokenizer(None),  # type: ignore[arg-type]  # never decodes
        max_total_tokens=len(prompt) + 1,
    )


def request_with_blocks(kv: KVCacheManager, num_tokens: int) -> Request:
    request = new_request(list(range(100, 100 + num_tokens)))
    assert kv.allocate_slots(request, num_tokens)
    return request


def ref_counts(kv: KVCacheManager) -> list[int]:
    return [block.ref_cnt for block in kv.pool.blocks]


def cache_first_block(kv: KVCacheManager, prompt: list[int]) -> int:
    """Block 0 computed for the prompt's first block, then freed: cached-free."""
    [block_id] = kv.pool.allocate(1)
    kv.pool.cache(block_id, prompt_block_hashes(prompt, BLOCK_SIZE)[0])
    kv.release([block_id])
    return block_id


def test_held_blocks_outlive_their_request_until_released():
    kv = manager(4)
    request = request_with_blocks(kv, 8)
    assert request.block_ids == [0, 1]
    kv.hold([0, 1])
    assert ref_counts(kv) == [2, 2, 0, 0]
    kv.free(request)
    assert ref_counts(kv) == [1, 1, 0, 0]
    assert kv.pool.num_free_blocks == 2
    kv.release([0, 1])
    assert ref_counts(kv) == [0, 0, 0, 0]
    assert kv.pool.num_free_blocks == 4
    with pytest.raises(AssertionError, match="double free of block 1"):
        kv.release([1])
    kv.check_integrity()


def test_a_prefix_fetch_holds_our_hits_and_allocates_the_blocks_past_them():
    kv = manager(8)
    prompt = list(range(100, 114))  # 14 tokens: 3 full blocks end before the last token
    cache_first_block(kv, prompt)
    own_ids = kv.claim_prefix(prompt)
    assert cached_in_pool(kv, prompt) == own_ids == [0]
    assert kv.reserve_prefix_fetch(2, max_used_blocks=3) == [1, 2]
    assert ref_counts(kv) == [1, 1, 1, 0, 0, 0, 0, 0]
    kv.release(own_ids + [1, 2])
    assert kv.pool.num_free_blocks == 8
    kv.check_integrity()


def test_a_block_is_registered_in_the_step_that_fills_it_and_again_after_a_preemption():
    kv = manager(8)
    request = new_request(list(range(100, 106)))  # 6 tokens: one full block
    assert kv.allocate_slots(request, 6)
    request.num_computed_tokens = 6
    kv.cache_computed_blocks(request)
    assert cached_blocks(kv, request.block_hashes) == request.block_ids[:1] == [0]
    for token in range(2):  # decoding fills the second block with its 8th token
        request.token_ids.append(token)
        assert kv.allocate_slots(request, 1)
        request.num_computed_tokens += 1
        kv.cache_computed_blocks(request)
    assert cached_blocks(kv, request.block_hashes) == request.block_ids[:2] == [0, 1]
    # Preempted: its blocks go back and the cache is dropped; recomputed, both are found again.
    kv.free(request)
    kv.reset_cache()
    request.num_computed_tokens = 0
    assert cached_blocks(kv, request.block_hashes) == []
    assert kv.allocate_slots(request, 8)
    request.num_computed_tokens = 8
    kv.cache_computed_blocks(request)
    assert cached_blocks(kv, request.block_hashes) == request.block_ids[:2]
    kv.free(request)
    kv.check_integrity()


def pool_lookups() -> dict[str, float]:
    return {
        result: REGISTRY.get_sample_value(
            "pdserve_kv_tier_lookups_total", {"tier": "pool", "result": result}
        ) or 0.0
        for result in ("hit", "miss")
    }  # fmt: skip


def test_a_planned_prefix_is_counted_once_in_the_lookup_metrics():
    """A fetch plan's walk (claim_prefix) is the request's lookup: the request's first match,
    which finds what the plan holds, counts nothing more; a later match counts again."""
    kv = manager(8)
    prompt = list(range(100, 114))  # 14 tokens: 3 full blocks end before the last token
    cache_first_block(kv, prompt)
    before = pool_lookups()
    own_ids = kv.claim_prefix(prompt)  # block 0 found, the next one not
    request = new_request(prompt)
    request.prefix_looked_up = True
    assert kv.match_prefix(request) == BLOCK_SIZE
    assert {r: n - before[r] for r, n in pool_lookups().items()} == {"hit": 1, "miss": 1}
    assert not request.prefix_looked_up
    kv.free(request)  # as a preemption does: its next match is a lookup of its own
    assert kv.match_prefix(request) == BLOCK_SIZE
    assert {r: n - before[r] for r, n in pool_lookups().items()} == {"hit": 2, "miss": 2}
    kv.free(request)
    kv.release(own_ids)
    assert kv.pool.num_free_blocks == 8
    kv.check_integrity()


@pytest.mark.parametrize(
    ("num_blocks", "max_used_blocks"),
    [(2, 2), (4, 8)],  # past the limit; more than the 3 blocks free besides our hit
)
def test_a_prefix_fetch_that_does_not_fit_takes_nothing(num_blocks, max_used_blocks):
    kv = manager(4)
    prompt = list(range(100, 114))
    cache_first_block(kv, prompt)
    own_ids = kv.claim_prefix(prompt)  # referenced first: not evicted to make room
    assert kv.reserve_prefix_fetch(num_blocks, max_used_blocks) is None
    assert ref_counts(kv) == [1, 0, 0, 0]
    kv.release(own_ids)
    assert cached_in_pool(kv, prompt) == [0]
    kv.check_integrity()


def test_quarantined_blocks_stay_out_of_use_until_released():
    kv = manager(4)
    request = request_with_blocks(kv, 8)
    held = kv.quarantine_remote_blocks(request)
    assert held == [0, 1]
    assert request.block_ids == []
    assert kv.quarantined == {0, 1}
    assert kv.pool.num_free_blocks == 2
    assert kv.pool.allocate(2) == [2, 3]  # never the quarantined ones
    with pytest.raises(NoFreeBlocksError):
        kv.pool.allocate(1)
    kv.check_integrity()
    kv.release_quarantined(held)
    assert kv.quarantined == set()
    assert kv.pool.allocate(2) == [0, 1]
    kv.check_integrity()


def test_quarantine_keeps_the_prefix_hits_with_the_request():
    kv = manager(4)
    request = request_with_blocks(kv, 12)
    request.num_cached_tokens = 4  # block 0 was a hit: no writer was given it
    assert kv.quarantine_remote_blocks(request) == [1, 2]
    assert request.block_ids == [0]
    assert ref_counts(kv) == [1, 1, 1, 0]
    kv.check_integrity()


def test_replaced_blocks_are_quarantined_and_the_request_gets_fresh_ones():
    kv = manager(6)
    request = request_with_blocks(kv, 12)
    request.num_cached_tokens = 4
    assert kv.replace_remote_blocks(request) == [1, 2]
    assert request.block_ids == [0, 3, 4]
    assert kv.quarantined == {1, 2}
    assert ref_counts(kv) == [1, 1, 1, 1, 1, 0]
    with pytest.raises(InsufficientKVError, match="prompt needs 2 KV blocks, 1 free"):
        kv.replace_remote_blocks(request)
    assert request.block_ids == [0, 3, 4]  # the refusal changed nothing
    assert kv.quarantined == {1, 2}
    kv.check_integrity()
    kv.free(request)
    kv.release_quarantined([1, 2])
    assert kv.pool.num_free_blocks == 6
    kv.check_integrity()


def test_integrity_check_catches_a_quarantined_block_that_is_free():
    kv = manager(2)
    kv.quarantine_remote_blocks(request_with_blocks(kv, 4))
    kv.release([0])  # a bug: freed while quarantined
    with pytest.raises(AssertionError, match="1 quarantined blocks are free"):
        kv.check_integrity()


def test_integrity_check_catches_a_quarantined_block_that_is_also_in_use():
    kv = manager(2)
    kv.quarantine_remote_blocks(request_with_blocks(kv, 4))
    kv.hold([0])  # a bug: another user of a block a writer may still reach
    with pytest.raises(AssertionError, match="1 quarantined blocks are also in use"):
        kv.check_integrity()


def test_integrity_check_includes_the_pools_own():
    kv = manager(3)
    request_with_blocks(kv, 4)
    kv.pool.blocks[0].ref_cnt = 0  # a leak the pool did not see
    with pytest.raises(AssertionError, match=r"block pool corrupt: 0 in use \+ 2 free"):
        kv.check_integrity()
