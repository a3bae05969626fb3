"""The scheduler's order within a step: prompts that finish in half a step go ahead of partial
prefills and longer waiting prompts, never past half the step, and never past a waiting
request the KV pool could not take; a prompt whose uncached prefix another prompt is filling
waits for it instead of computing it again."""

from __future__ import annotations

import pytest

from engine import EngineConfig, LLMEngine, SamplingParams
from tests.engine.idle import reset_to_idle

PARAMS = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
CHUNK = 256


def prompt(n: int, first: int = 100) -> list[int]:
    return [first + i % 1000 for i in range(n)]


@pytest.fixture(scope="module")
def engine():
    # Every prompt that fits joins its step: these tests are about the order within a step, not
    # about splitting a burst over steps (tests/sim/test_step_packing.py).
    config = EngineConfig(num_blocks=64, chunk_size=CHUNK, num_threads=1, device="cpu",
                          step_overhead_tokens=0)  # fmt: skip
    return LLMEngine(config)


@pytest.fixture(autouse=True)
def idle(engine):
    yield
    reset_to_idle(engine)


def computed(*requests) -> list[int]:
    return [r.num_computed_tokens for r in requests]


def test_a_short_prompt_goes_ahead_of_a_partial_prefill(engine):
    long = engine.add_request("long", prompt(600), PARAMS)
    engine.step()
    short = engine.add_request("short", prompt(40, 2000), PARAMS)
    engine.step()
    # The long prompt's chunk gave the short one its 40 tokens; the short one has its token.
    assert computed(long, short) == [256 + 216, 40]
    assert short.num_output_tokens == 1
    engine.step()
    assert computed(long, short) == [600, 41]


def test_a_short_prompt_goes_ahead_of_a_longer_one_that_arrived_first(engine):
    long = engine.add_request("long", prompt(600), PARAMS)
    short = engine.add_request("short", prompt(40, 2000), PARAMS)
    engine.step()
    assert computed(long, short) == [216, 40]


def test_short_prompts_take_at_most_half_a_step(engine):
    long = engine.add_request("long", prompt(600), PARAMS)
    shorts = [engine.add_request(f"s{i}", prompt(100, 2000 + i), PARAMS) for i in range(3)]
    engine.step()
    # 100 + 100 > 128: one goes ahead, the long prompt takes the rest of the step.
    assert computed(long, *shorts) == [156, 100, 0, 0]
    engine.step()
    # The next: s0's decode token, the long prompt's 155 and s1's 100.
    assert computed(long, *shorts) == [156 + 155, 101, 100, 0]


def test_nothing_goes_ahead_of_a_request_the_pool_cannot_take(engine):
    # 64 blocks of 16, 85% watermark: 54 blocks. 700 tokens hold 44; a waiting 300-token
    # prompt needs 16 more for its first chunk and waits; a short one arriving after it waits
    # behind it, though 3 blocks would fit under the watermark.
    big = engine.add_request("big", prompt(700), SamplingParams(max_tokens=50, ignore_eos=True))
    for _ in range(3):
        engine.step()
    assert big.num_output_tokens == 1
    blocked = engine.add_request("blocked", prompt(300, 3000), PARAMS)
    engine.step()
    assert computed(blocked) == [0]
    short = engine.add_request("short", prompt(40, 2000), PARAMS)
    engine.step()
    assert computed(blocked, short) == [0, 0]
    engine.abort_request("big")
    engine.step()
    # The blocked request is admitted first; the short one goes ahead once nothing is blocked.
    assert computed(blocked, short) == [256, 0]
    engine.step()
    assert computed(blocked, short) == [300, 40]


def test_a_prefix_another_prompt_is_filling_is_computed_once(engine):
    system = prompt(160)  # 10 blocks no cache holds
    first = engine.add_request("first", system + prompt(40, 2000), PARAMS)
    second = engine.add_request("second", system + prompt(40, 3000), PARAMS)
    other = engine.add_request("other", prompt(200, 4000), PARAMS)
    engine.step()
    # The second waits for the shared blocks; the unrelated prompt behind it does not.
    assert computed(first, second, other) == [200, 0, 56]
    # The load reported: the second's 40 tokens past the 160 it would hit now (the router
    # counts a placement so), and the rest of the unrelated prompt.
    assert engine.stats().num_queued_tokens == 40 + (200 - 56)
    engine.step()
    # The second finds the 160 shared tokens cached and computes its own 40.
    assert computed(first, second, other) == [201, 200, 200]
    assert second.num_cached_tokens == 160
    assert second.num_output_tokens == 1


def test_without_prefix_caching_prompts_sharing_a_prefix_compute_it_together():
    config = EngineConfig(
        num_blocks=64, chunk_size=CHUNK, num_threads=1, device="cpu", enable_prefix_caching=False
    )
    engine = LLMEngine(config)
    system = prompt(160)
    first = engine.add_request("first", system + prompt(40, 2000), PARAMS)
    second = engine.add_request("second", system + prompt(40, 3000), PARAMS)
    engine.step()
    assert computed(first, second) == [200, 56]
