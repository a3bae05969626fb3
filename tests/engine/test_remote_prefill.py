"""The decode side of disaggregation in the engine: reservations respect the batch limits, and
blocks an unfenced writer may reach are quarantined, never handed to another request."""

from __future__ import annotations

from dataclasses import replace

import pytest

from engine import EngineBusyError, EngineConfig, LLMEngine, SamplingParams
from tests.engine.idle import reset_to_idle

PARAMS = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
PROMPT = list(range(100, 140))  # 40 tokens: 3 blocks of 16


@pytest.fixture(scope="module")
def engine():
    return LLMEngine(EngineConfig(num_blocks=12, max_num_seqs=2, num_threads=1, device="cpu"))


@pytest.fixture(autouse=True)
def idle(engine):
    yield
    reset_to_idle(engine)


def test_reservations_past_max_num_seqs_are_refused(engine):
    engine.reserve_for_remote_prefill("a", PROMPT, PARAMS)
    engine.reserve_for_remote_prefill("b", PROMPT, PARAMS)
    with pytest.raises(EngineBusyError, match="2 requests are running or awaiting KV; max_num_"):
        engine.reserve_for_remote_prefill("c", PROMPT, PARAMS)
    assert engine.pool.num_free_blocks == 6  # the refusal took nothing


def test_n_samples_count_against_max_num_seqs_unless_the_engine_is_idle(engine):
    two = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, n=2)
    engine.reserve_for_remote_prefill("a", PROMPT, PARAMS)
    with pytest.raises(EngineBusyError, match=(
        "^1 requests are running or awaiting KV; max_num_seqs is 2; its 2 samples would pass it$"
    )):  # fmt: skip
        engine.reserve_for_remote_prefill("b", PROMPT, two)
    engine.abort_request("a")
    engine.reserve_for_remote_prefill("c", PROMPT, replace(two, n=3))  # idle: the rest queue


def test_reservations_past_the_watermark_are_refused(engine):
    engine.reserve_for_remote_prefill("a", list(range(100, 260)), PARAMS)  # 10 of 12 blocks
    with pytest.raises(EngineBusyError, match="10 of 12 are in use and new work may fill 10"):
        engine.reserve_for_remote_prefill("b", PROMPT, PARAMS)
    assert engine.pool.num_free_blocks == 2


def test_an_unfenced_attempt_is_retried_on_fresh_blocks(engine):
    reserved = engine.reserve_for_remote_prefill("a", PROMPT, PARAMS)
    first_ids = list(reserved.block_ids)
    assert len(first_ids) == 3
    assert engine.replace_remote_blocks("a") == first_ids
    assert len(reserved.block_ids) == 3 and not set(reserved.block_ids) & set(first_ids)
    assert engine.kv.quarantined == set(first_ids)
    assert engine.abort_remote_prefill("a", writer_fenced=True) == []
    assert engine.pool.num_free_blocks == 9  # the fresh blocks are free, the unfenced are not
    engine.kv.release_quarantined(first_ids)


def test_an_unfenced_abort_quarantines_only_the_blocks_the_writer_was_given(engine):
    engine.reserve_for_remote_prefill("a", PROMPT, PARAMS)
    first = engine.commit_remote_prefill("a", 7)  # its 2 full blocks enter the prefix cache
    assert first.new_token_ids == [7]
    engine.abort_request("a")
    reserved = engine.reserve_for_remote_prefill("b", PROMPT, PARAMS)
    assert reserved.num_cached_tokens == 32  # 2 blocks hit; the writer gets only the last
    hit_ids, written_ids = reserved.block_ids[:2], reserved.block_ids[2:]
    quarantined = engine.abort_remote_prefill("b", writer_fenced=False)
    assert quarantined == written_ids
    assert engine.kv.quarantined == set(quarantined)
    assert all(engine.pool.blocks[i].ref_cnt == 0 for i in hit_ids)  # cached, free again
    engine.kv.release_quarantined(quarantined)
