"""The host KV tier under the block pool: a prefix the pool evicted is loaded back from it and
gives the same tokens as a pool hit and a miss; both tiers stay whole and every byte comes back
as it went; a full tier drops its least recently used block; a damaged tier file, or one whose
loads measure slower than computing, is passed over and the prefix computed instead."""

from __future__ import annotations

import os
import random

import pytest
import torch

from engine import LLM, SamplingParams
from engine.config import EngineConfig
from engine.errors import InvalidRequestError
from engine.kv_tier import HostKVTier, host_tier
from engine.prefix_hash import prompt_block_hashes
from tests.engine.kv_state import cached_in_pool

BLOCK_SIZE = 16
BLOCK_BYTES = BLOCK_SIZE * 46_080  # SmolLM2-135M's fp32 KV: one block
NUM_SLOTS = 12
PROMPT = "You are a careful assistant. " * 20 + "What is two plus two?"  # 7 full blocks
GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def tiered(tmp_path_factory):
    """An fp32 engine with a 24-block pool over a 12-block tier in a file; each test starts by
    forgetting both tiers and leaves the engine idle."""
    llm = LLM(
        num_threads=2, device="cpu", num_blocks=24, quantization="none",
        kv_offload_gb=NUM_SLOTS * BLOCK_BYTES / 2**30,
        kv_offload_path=str(tmp_path_factory.mktemp("kv-tier")),
    )  # fmt: skip
    assert llm.engine.tier.num_slots == NUM_SLOTS
    return llm


def evict_pool(llm: LLM) -> None:
    """Every cached-free block leaves the pool, written back to the tier (as a busy pool
    would evict them for new work)."""
    pool = llm.engine.pool
    pool.free(pool.allocate(pool.num_free_blocks))
    assert not pool.hash_to_block


def assert_idle_and_whole(llm: LLM) -> None:
    engine = llm.engine
    assert engine.pool.num_free_blocks == engine.pool.num_blocks
    engine.kv.check_integrity()


def test_a_tier_hit_gives_the_tokens_of_a_pool_hit_and_a_miss(tiered):
    engine = tiered.engine
    engine.kv.reset_cache()
    miss = tiered.generate([PROMPT], GREEDY)[0]
    pool_hit = tiered.generate([PROMPT], GREEDY)[0]
    evict_pool(tiered)
    loaded_before = engine.tier.stats.num_loaded_blocks
    host_hit_before = engine.kv.stats.num_host_hit_tokens
    tier_hit = tiered.generate([PROMPT], GREEDY)[0]

    num_full = (len(miss.prompt_token_ids) - 1) // BLOCK_SIZE
    assert num_full == 7
    assert [miss.num_cached_tokens, pool_hit.num_cached_tokens, tier_hit.num_cached_tokens] == [
        0, num_full * BLOCK_SIZE, num_full * BLOCK_SIZE,
    ]  # fmt: skip
    assert engine.tier.stats.num_loaded_blocks - loaded_before == num_full
    assert engine.kv.stats.num_host_hit_tokens - host_hit_before == num_full * BLOCK_SIZE
    assert tier_hit.token_ids == pool_hit.token_ids == miss.token_ids
    assert_idle_and_whole(tiered)


def test_a_tier_that_loads_slower_than_computing_is_computed_instead():
    """Once a block's load has measured slower than computing its tokens, the prefix past the
    pool is computed: the walk stops at the first such block, and the tokens are the same."""
    llm = LLM(num_threads=2, device="cpu", num_blocks=24, quantization="none",
              kv_offload_gb=NUM_SLOTS * BLOCK_BYTES / 2**30)  # fmt: skip
    engine = llm.engine
    reference = llm.generate([PROMPT], GREEDY)[0]  # its prompt step measures the prefill speed
    assert 0 < BLOCK_SIZE * engine.kv.prefill_s_per_token < 1.0
    ticks = iter(range(100))
    engine.tier.clock = lambda: float(next(ticks))  # every load now takes a second
    evict_pool(llm)

    served = llm.generate([PROMPT], GREEDY)[0]
    assert served.num_cached_tokens == BLOCK_SIZE  # the first block, whose load measured it
    assert engine.tier.load_s_per_block == 1.0
    assert engine.tier.stats.num_loaded_blocks == 1
    assert engine.kv.stats.num_host_skipped_tokens == BLOCK_SIZE  # the second; the walk stops
    assert engine.stats().host_load_s_per_token == 1.0 / BLOCK_SIZE
    assert served.token_ids == reference.token_ids
    assert_idle_and_whole(llm)


def block_bytes_for(block_hash: bytes) -> torch.Tensor:
    """What a block 'computes' to: a function of its hash, as KV is of its tokens."""
    seed = int.from_bytes(block_hash[:8], "little")
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (BLOCK_BYTES,), dtype=torch.uint8, generator=generator)


def tier_file_bytes(tier: HostKVTier, block_hash: bytes) -> bytes:
    slot = tier.hash_to_slot[block_hash]
    return os.pread(tier.slots.fd, tier.block_bytes, slot * tier.block_bytes)


def test_random_evictions_and_loads_keep_both_tiers_whole_and_every_byte(tiered):
    """Requests of random prompts (2-6 blocks) through the real KV cache manager, each block's
    bytes written as a step would; 36 blocks of room for ~50 distinct ones, so blocks move
    both ways and the tier drops some. Every hit holds exactly its bytes, both integrity
    checks pass after every request, and at the end so does every cached byte of each tier."""
    engine = tiered.engine
    kv, tier, pool_bytes = engine.kv, engine.tier, engine.tier.slots.pool_bytes
    kv.reset_cache()
    before = (tier.stats.num_loaded_blocks, tier.stats.num_evicted_blocks)
    rng = random.Random(0)
    prompts = [
        [rng.randrange(100, 40_000) for _ in range(BLOCK_SIZE * rng.randint(2, 6) + 1)]
        for _ in range(12)
    ]
    for step in range(48):
        prompt = rng.choice(prompts)
        request = engine.make_request(f"random-{step}", prompt, GREEDY)
        num_hit = kv.match_prefix(request)
        for block_id, block_hash in zip(request.block_ids, request.block_hashes, strict=False):
            assert torch.equal(pool_bytes[block_id], block_bytes_for(block_hash)), step
        request.num_computed_tokens = num_hit
        assert kv.allocate_slots(request, len(prompt) - num_hit)
        num_full = len(prompt) // BLOCK_SIZE
        for i in range(num_hit // BLOCK_SIZE, num_full):
            pool_bytes[request.block_ids[i]] = block_bytes_for(request.block_hashes[i])
        request.num_computed_tokens = len(prompt)
        kv.cache_computed_blocks(request)
        kv.free(request)
        kv.check_integrity()

    assert tier.stats.num_loaded_blocks > before[0] and tier.stats.num_evicted_blocks > before[1]
    for block_hash, block_id in engine.pool.hash_to_block.items():
        assert torch.equal(pool_bytes[block_id], block_bytes_for(block_hash))
    assert tier.num_used_slots == NUM_SLOTS
    for block_hash in tier.hash_to_slot:
        assert tier_file_bytes(tier, block_hash) == block_bytes_for(block_hash).numpy().tobytes()
    kv.reset_cache()  # the random bytes must not serve a real prompt later
    assert_idle_and_whole(tiered)


def test_a_full_tier_drops_its_least_recently_used_block():
    """In host memory, over a pool of int8 rows (stored as they are): a load counts as a use."""
    cache = torch.randint(-127, 128, (4, 2, 2, 4, 1, 6), dtype=torch.int8)  # 4 blocks, 96 B each
    original = cache.clone()
    tier = host_tier(cache, capacity_bytes=2 * 96 + 95, path=None)  # two slots, not three
    assert tier.num_slots == 2
    a, b, c = b"a" * 16, b"b" * 16, b"c" * 16
    tier.store(0, a)
    tier.store(1, b)
    assert tier.load(a, 2)  # a is now the most recently used
    assert torch.equal(cache[2], original[0])
    tier.store(3, c)  # full: b goes
    assert list(tier.hash_to_slot) == [a, c]
    assert tier.stats.num_evicted_blocks == 1
    assert not tier.load(b, 2)
    assert tier.load(c, 0) and torch.equal(cache[0], original[3])
    tier.check_integrity()


def test_a_corrupted_tier_block_is_refused_and_computed(tiered):
    engine = tiered.engine
    tier = engine.tier
    engine.kv.reset_cache()
    reference = tiered.generate([PROMPT], GREEDY)[0]
    evict_pool(tiered)
    second = prompt_block_hashes(reference.prompt_token_ids, BLOCK_SIZE)[1]
    offset = tier.hash_to_slot[second] * tier.block_bytes + 1000
    flipped = bytes([tier_file_bytes(tier, second)[1000] ^ 0xFF])
    os.pwrite(tier.slots.fd, flipped, offset)
    failed_before = tier.stats.num_failed_loads

    served = tiered.generate([PROMPT], GREEDY)[0]
    assert served.num_cached_tokens == BLOCK_SIZE  # the first block only
    assert tier.stats.num_failed_loads == failed_before + 1
    assert second not in tier
    assert served.token_ids == reference.token_ids
    assert_idle_and_whole(tiered)


def test_a_truncated_tier_file_is_refused_and_computed(tiered):
    engine = tiered.engine
    tier = engine.tier
    engine.kv.reset_cache()
    reference = tiered.generate([PROMPT], GREEDY)[0]
    evict_pool(tiered)
    failed_before = tier.stats.num_failed_loads
    os.ftruncate(tier.slots.fd, 0)
    try:
        served = tiered.generate([PROMPT], GREEDY)[0]
    finally:
        os.ftruncate(tier.slots.fd, NUM_SLOTS * BLOCK_BYTES)
    assert served.num_cached_tokens == 0
    assert tier.stats.num_failed_loads == failed_before + 1
    assert served.token_ids == reference.token_ids
    assert_idle_and_whole(tiered)


def test_a_remote_prefill_reservation_takes_its_prefix_from_the_tier(tiered):
    """The decode worker's side of a disaggregated request: blocks its tier holds are loaded
    into the reservation, and the prefill worker is asked only for the rest."""
    engine = tiered.engine
    engine.kv.reset_cache()
    reference = tiered.generate([PROMPT], GREEDY)[0]
    evict_pool(tiered)
    request = engine.reserve_for_remote_prefill("remote", reference.prompt_token_ids, GREEDY)
    assert request.num_cached_tokens == 7 * BLOCK_SIZE
    assert engine.kv.first_remote_block(request) == 7
    engine.abort_remote_prefill("remote", writer_fenced=True)
    assert_idle_and_whole(tiered)


def test_a_prefill_worker_loads_from_its_own_tier_what_it_would_have_read_from_a_peer(tiered):
    """The prefill worker's side of a prefix fetch: blocks its own tier holds count as its
    hits (a memory copy, not a transfer), so a peer holding no more is not read at all, and a
    peer holding more is read only past them."""
    from prefill_service.request_path import FetchCosts, plan_prefix_fetch

    engine = tiered.engine
    engine.kv.reset_cache()
    reference = tiered.generate([PROMPT], GREEDY)[0]
    prompt = reference.prompt_token_ids
    fast = FetchCosts(kv_bytes_per_token=4096, kv_bytes_per_s=1e12)
    evict_pool(tiered)
    host_hit_before = engine.kv.stats.num_host_hit_tokens
    assert plan_prefix_fetch(engine, prompt, 7, fast, prefill_tokens_per_s=100.0) is None
    assert engine.kv.stats.num_host_hit_tokens - host_hit_before == 7 * BLOCK_SIZE
    assert len(cached_in_pool(engine.kv, prompt)) == 7  # back in the pool, no reference held
    assert_idle_and_whole(tiered)
    # Its first 4 blocks only, in the tier: a peer holding all 7 is read for the last 3.
    engine.kv.reset_cache()
    tiered.generate([prompt[: 4 * BLOCK_SIZE + 1]], GREEDY)
    evict_pool(tiered)
    plan = plan_prefix_fetch(engine, prompt, 7, fast, prefill_tokens_per_s=100.0)
    assert plan is not None and (len(plan.own_ids), len(plan.dst_ids)) == (4, 3)
    engine.kv.release(plan.own_ids + plan.dst_ids)  # as the request's end does
    served = tiered.generate([PROMPT], GREEDY)[0]
    assert (served.num_cached_tokens, served.token_ids) == (4 * BLOCK_SIZE, reference.token_ids)
    assert_idle_and_whole(tiered)


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        (dict(kv_offload_gb=-1.0), "kv_offload_gb must be a number >= 0, got -1.0"),
        (dict(kv_offload_gb=float("nan")), "kv_offload_gb must be a number >= 0, got nan"),
        (dict(kv_offload_path="/tmp"), "kv_offload_path '/tmp' is set but kv_offload_gb is 0"),
        (
            dict(kv_offload_gb=1.0, kv_offload_path="/no/such/dir"),
            "kv_offload_path '/no/such/dir' is not an existing directory",
        ),
        (
            dict(kv_offload_gb=1.0, enable_prefix_caching=False),
            "kv_offload_gb needs prefix caching",
        ),
    ],
)
def test_offload_settings_are_checked(settings, message):
    with pytest.raises(InvalidRequestError) as raised:
        EngineConfig(device="cpu", **settings)
    assert message in str(raised.value)


@pytest.mark.parametrize(
    ("capacity_bytes", "path", "message"),
    [
        (24_575, None, r"less than one KV block \(24576 bytes\)"),
        (2**60, None, r"asks for 1073741824.0 GiB, more than the .* GiB of host memory"),
        (2**60, "/tmp", r"asks for 1073741824.0 GiB, more than the .* GiB of free space in /tmp"),
    ],
)
def test_a_tier_the_host_cannot_hold_is_refused(capacity_bytes, path, message):
    cache = torch.zeros(2, 1, 2, 16, 3, 64)  # 24,576 B a block
    with pytest.raises(InvalidRequestError, match=message):
        host_tier(cache, capacity_bytes, path)


def test_a_block_leaving_the_pool_for_the_tier_is_one_event_in_each(tiered):
    """What the worker publishes (pdserve/kv_events.py): evicted from the pool, stored in the
    host tier, under the same hash; loaded back, stored in the pool again."""
    engine = tiered.engine
    engine.kv.reset_cache()
    reference = tiered.generate([PROMPT], GREEDY)[0]
    hashes = prompt_block_hashes(reference.prompt_token_ids, BLOCK_SIZE)
    pool, tier = engine.pool, engine.tier
    pool.record_events = tier.record_events = True
    try:
        evict_pool(tiered)
        evicted = [h for stored, h in pool.take_cache_events() if not stored]
        assert tier.take_events() == [(True, h) for h in evicted]
        assert set(hashes) <= set(evicted)
        tiered.generate([PROMPT], GREEDY)
        stored = [h for is_stored, h in pool.take_cache_events() if is_stored]
        assert stored[: len(hashes)] == list(hashes)  # loaded back in prompt order
        assert tier.take_events() == []  # the tier keeps its copies: nothing left it
    finally:
        pool.record_events = tier.record_events = False
    assert_idle_and_whole(tiered)
