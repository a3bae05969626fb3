"""The prefix scorers, table-driven and pure: a cached prefix wins at equal load, load wins
over a cached prefix when the holder is busy enough, and the choice's overlap is recorded."""

from __future__ import annotations

from dataclasses import replace

import pytest
from router_harness import pool_of, ticket, with_load, worker

from engine.prefix_hash import prompt_block_hashes
from pdserve.kv_events import CacheUpdate
from router.prefix_index import HOST_TOKEN_WORTH, Choice, PrefixIndex, _WorkerBits
from router.routing import build_policies
from router.settings import AdmissionSettings, RoutingSettings

PROMPT = list(range(1000, 1400))  # 400 tokens: 24 blocks a cache can serve
HASHES = prompt_block_hashes(PROMPT, 16)


def index_with(holdings: dict[str, int]) -> PrefixIndex:
    """Each worker caches that many leading blocks of PROMPT."""
    index = PrefixIndex()
    for worker_id, num_blocks in holdings.items():
        index.apply(worker_id, "1-0", CacheUpdate(True, HASHES[:num_blocks]))
    return index


def prompt_ticket():
    return replace(ticket("r", len(PROMPT), prompt=PROMPT), block_hashes=HASHES)


PREFILL_CASES = [
    # (b's queued tokens, b's block size, prefill weight, chosen): a holds nothing, b holds
    # 20 blocks (320 tokens = 0.64 s at 500 tokens/s); both run at 500 tokens/s.
    pytest.param(0, 16, 0.6, "b", id="equal-load-the-holder-wins"),
    pytest.param(300, 16, 0.6, "b", id="less-queued-than-it-saves"),
    pytest.param(340, 16, 0.6, "a", id="more-queued-than-it-saves"),
    pytest.param(2000, 16, 0.6, "a", id="heavily-loaded-holder-load-wins"),
    pytest.param(0, 16, 0.0, "a", id="weight-0-is-load-only"),
    pytest.param(0, 32, 0.6, "a", id="other-block-size-never-matches"),
]


@pytest.mark.parametrize("queued, block_size, weight, expected", PREFILL_CASES)
def test_prefill_choice_weighs_saved_prefill_against_load(queued, block_size, weight, expected):
    a = worker("prefill", "a", tokens_per_s=500)
    b = replace(worker("prefill", "b", tokens_per_s=500, queued_tokens=queued),
                block_size=block_size)  # fmt: skip
    index = index_with({"b": 20})
    routing = RoutingSettings("watermark", prefix_prefill_weight=weight)
    policies = build_policies(routing, AdmissionSettings(), index)
    assert policies.prefill.choose(pool_of(a, b).views("prefill"), prompt_ticket()).worker_id == (
        expected
    )


FETCH_CASES = [
    # (a fetches, b's queued tokens, chosen): b holds 20 blocks (320 tokens) and fetches; the
    # chosen decode worker holds all 24 (384) and lets them be read. A read token is credited
    # 0.9 of a cached one: a saves 345.6 tokens' prefill, b 377.6 (0.69 s and 0.76 s).
    pytest.param(True, 0, "b", id="equal-load-the-holder-still-wins"),
    pytest.param(True, 100, "a", id="a-little-load-and-a-reader-does-as-well"),
    pytest.param(False, 100, "b", id="no-fetch-the-holder-wins-as-before"),
]


@pytest.mark.parametrize("a_fetches, queued, expected", FETCH_CASES)
def test_a_prefill_worker_that_fetches_is_credited_the_decode_workers_prefix(
    a_fetches, queued, expected
):
    a = replace(worker("prefill", "a", tokens_per_s=500), peer_fetch=a_fetches)
    b = replace(worker("prefill", "b", tokens_per_s=500, queued_tokens=queued), peer_fetch=True)
    policies = build_policies(
        RoutingSettings("watermark"), AdmissionSettings(), index_with({"b": 20})
    )
    held = replace(prompt_ticket(), held_prefix_tokens=384)
    assert policies.prefill.choose(pool_of(a, b).views("prefill"), held).worker_id == expected


DECODE_CASES = [
    # (running requests on b, decode weight, chosen): b holds 24 blocks (384 of 400 tokens).
    pytest.param(0, 0.5, "b", id="equal-load-the-holder-wins"),
    pytest.param(4, 0.5, "a", id="busy-holder-load-wins"),
    pytest.param(0, 0.0, "a", id="weight-0-is-load-only"),
]


@pytest.mark.parametrize("running, weight, expected", DECODE_CASES)
def test_decode_choice_weighs_held_kv_against_load(running, weight, expected):
    a = worker("decode", "a")
    b = with_load(worker("decode", "b"), running_requests=running)
    policies = build_policies(
        RoutingSettings("watermark", prefix_decode_weight=weight), AdmissionSettings(),
        index_with({"b": 24}),
    )  # fmt: skip
    view = policies.decode.choose(pool_of(a, b).views("decode"), prompt_ticket())
    assert view.worker_id == expected


def test_overlap_counts_only_the_leading_cached_blocks_and_is_recorded():
    index = index_with({"p": 24, "d": 10})
    index.apply("p", "2-0", CacheUpdate(False, (), (HASHES[5],)))  # a hole at block 5
    p, d = worker("prefill", "p"), worker("decode", "d")
    choice = index.record(prompt_ticket(), p, d)
    assert choice == Choice("r", "p", 5 * 16, "d", 10 * 16)
    assert index.worker_json("p") == {
        "cached_blocks": 23, "host_cached_blocks": 0, "last_overlap_tokens": 80,
    }  # fmt: skip
    assert index.recent_json()[-1]["decode_overlap_tokens"] == 160
    index.retain({"d"})
    assert index.worker_json("p") == {
        "cached_blocks": 0, "host_cached_blocks": 0, "last_overlap_tokens": None,
    }  # fmt: skip


def test_a_host_tier_hit_scores_below_a_pool_hit_and_above_a_miss():
    """pool holds the prefix in its pool, host the same in its host tier (the pool evicted it
    there), none nothing; all equally loaded."""
    index = index_with({"pool": 20})
    index.apply("host", "1-0", CacheUpdate(True, (), host_stored=HASHES[:20]))
    index.apply("mixed", "1-0", CacheUpdate(True, HASHES[:10], host_stored=HASHES[:20]))
    workers = {w: worker("prefill", w, tokens_per_s=500) for w in ("pool", "host", "none")}
    overlaps = {w: index.overlap_tokens(info, prompt_ticket()) for w, info in workers.items()}
    assert overlaps == {"pool": 320, "host": round(320 * HOST_TOKEN_WORTH), "none": 0}
    assert round(320 * HOST_TOKEN_WORTH) == 304  # whole tokens, below the pool's 320
    assert index.overlap_tokens(worker("prefill", "mixed"), prompt_ticket()) == round(
        160 + 160 * HOST_TOKEN_WORTH
    )
    assert index.holders(prompt_ticket()) == {"pool", "host", "mixed"}
    policies = build_policies(RoutingSettings("watermark"), AdmissionSettings(), index)
    choose = policies.prefill.choose
    assert choose(pool_of(*workers.values()).views("prefill"), prompt_ticket()).worker_id == "pool"
    without_pool = pool_of(workers["host"], workers["none"]).views("prefill")
    assert choose(without_pool, prompt_ticket()).worker_id == "host"
    # Leaving the host tier is an eviction there: the block no longer counts.
    index.apply("host", "2-0", CacheUpdate(False, (), host_evicted=(HASHES[0],)))
    assert index.overlap_tokens(workers["host"], prompt_ticket()) == 0


HOST_WORTH_CASES = [
    # (host tier's load seconds a token, prefill tokens/s, overlap of 10 pool + 10 host blocks):
    pytest.param(0.0, 500, 160 + 152, id="unmeasured-tier-counts-0.95"),
    pytest.param(2e-4, 0, 160 + 152, id="unmeasured-prefill-counts-0.95"),
    pytest.param(2e-4, 500, 160 + 144, id="load-costs-a-tenth-of-compute"),
    pytest.param(1e-9, 500, 160 + 159, id="a-free-load-still-a-token-below-the-pool"),
    pytest.param(4e-3, 500, 160, id="load-slower-than-compute-counts-from-the-pool-only"),
]


@pytest.mark.parametrize("load_s_per_token, tokens_per_s, expected", HOST_WORTH_CASES)
def test_a_host_tier_token_is_worth_what_its_measured_load_saves(
    load_s_per_token, tokens_per_s, expected
):
    index = PrefixIndex()
    index.apply("w", "1-0", CacheUpdate(True, HASHES[:10], host_stored=HASHES[10:20]))
    measured = with_load(worker("prefill", "w", tokens_per_s=tokens_per_s),
                         host_load_s_per_token=load_s_per_token)  # fmt: skip
    assert index.overlap_tokens(measured, prompt_ticket()) == expected


def test_worker_bits_go_lowest_free_first_and_read_back_as_ids():
    bits = _WorkerBits()
    assert [bits.bit(w) for w in ("a", "b", "c", "a")] == [0b1, 0b10, 0b100, 0b1]
    assert bits.worker_ids(0b101) == {"a", "c"}
    assert bits.worker_ids(0) == set()
    bits.free("b")
    bits.free("a")
    assert [bits.bit(w) for w in ("d", "e", "f")] == [0b1, 0b10, 0b1000]
    assert bits.worker_ids(0b1111) == {"d", "e", "c", "f"}


def test_a_forgotten_workers_bit_credits_nothing_to_the_worker_given_it_next():
    index = index_with({"a": 4, "b": 2})  # a has bit 0b01, b 0b10
    index.retain({"b"})
    assert index.pool.holders == {HASHES[0]: 0b10, HASHES[1]: 0b10}
    index.apply("c", "1-0", CacheUpdate(True, HASHES[:1]))  # c is given a's bit
    assert index.pool.holders == {HASHES[0]: 0b11, HASHES[1]: 0b10}
    assert index.holders(prompt_ticket()) == {"b", "c"}
    index.apply("b", "2-0", CacheUpdate(False, (), HASHES[:2]))
    assert index.pool.holders == {HASHES[0]: 0b01}
    assert index.holders(prompt_ticket()) == {"c"}


def test_negative_weights_are_refused():
    from router.settings import SettingsError

    with pytest.raises(SettingsError, match="prefix_decode_weight=-1 must be >= 0"):
        RoutingSettings(prefix_decode_weight=-1)
