"""n samples of one prompt: sample 0 is the request, the engine forks the others once its
prompt is computed; they share the prompt's KV through the prefix cache, sample i draws from
seed + i (so it equals an n = 1 request with that seed), and every block is free at the end."""

from __future__ import annotations

import pytest

from engine import InvalidRequestError, SamplingParams
from engine.engine_loop import EngineLoop
from engine.llm_engine import LLMEngine
from engine.request import StepOutput, sample_ids

# 26 tokens: one full block of 16, which the samples find in the prefix cache.
PROMPT = (
    "Parallel sampling test: write one short sentence about the sea, then stop. The sea is "
    "wide and deep, and the waves are"
)


def run_all(engine: LLMEngine) -> dict[str, list[StepOutput]]:
    outputs: dict[str, list[StepOutput]] = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            outputs.setdefault(output.request_id, []).append(output)
    return outputs


def test_seeded_samples_equal_single_requests_with_seed_plus_index(llm):
    engine = llm.engine
    engine.pool.reset_cache()  # no earlier test's blocks of PROMPT: only the samples share
    params = SamplingParams(max_tokens=8, temperature=1.0, seed=123, n=3, ignore_eos=True)
    queried_before = engine.kv.stats.num_queried_tokens
    hits_before = engine.kv.stats.num_hit_tokens
    engine.add_request("par", PROMPT, params)
    outputs = run_all(engine)
    num_prompt = len(engine.tokenizer.encode(PROMPT))
    # Samples 1 and 2 hit every full prompt block but the last token's (sample 0 computed it).
    num_hit = (num_prompt - 1) // 16 * 16
    assert (num_prompt, num_hit) == (26, 16)
    assert engine.kv.stats.num_hit_tokens - hits_before == 2 * num_hit
    assert engine.kv.stats.num_queried_tokens - queried_before == 3 * num_prompt
    assert sorted(outputs) == sample_ids("par", 3) == ["par", "par#1", "par#2"]
    assert [o[-1].index for o in outputs.values()] == [0, 1, 2]

    alone = llm.generate([PROMPT] * 3, [params.sample(i) for i in range(3)])
    for i, sample_id in enumerate(sample_ids("par", 3)):
        assert [t for o in outputs[sample_id] for t in o.new_token_ids] == alone[i].token_ids
    assert len({tuple(a.token_ids) for a in alone}) == 3  # temperature 1: three samples
    assert engine.pool.num_free_blocks == engine.pool.num_blocks
    engine.kv.check_integrity()


def test_sample_params_seed_plus_index_wraps_at_64_bits():
    params = SamplingParams(seed=(1 << 64) - 1, n=2)
    assert (params.sample(0).seed, params.sample(1).seed, params.sample(1).n) == (
        (1 << 64) - 1, 0, 1,
    )  # fmt: skip
    assert SamplingParams(n=2).sample(1).seed is None


@pytest.mark.parametrize("n", [0, 17])
def test_n_out_of_range_is_refused(n):
    with pytest.raises(InvalidRequestError, match=rf"^n must be in \[1, 16\], got {n}$"):
        SamplingParams(n=n)


def test_a_request_id_cannot_take_a_samples_name(llm):
    with pytest.raises(InvalidRequestError, match="contains '#', which names samples"):
        llm.engine.make_request("x#1", PROMPT, SamplingParams())


def test_abort_through_the_loop_ends_every_sample_and_frees_every_block(llm):
    """The loop's abort ends sample 0 before and the forked samples after the fork alike."""
    engine = llm.engine
    loop = EngineLoop(engine).start()
    try:
        params = SamplingParams(max_tokens=2000, temperature=1.0, n=3, ignore_eos=True)

        def start():
            engine.add_request("ab", PROMPT, params)
            return loop.open_stream("ab", 3)

        stream = loop.call(start)
        seen: set[int] = set()
        for output in stream:
            if output.new_token_ids:
                seen.add(output.index)
            if len(seen) == 3:  # every sample is decoding: abort them all
                loop.abort("ab", 3)
                break
        rest = list(stream)
        assert sorted((o.index, o.finish_reason) for o in rest if o.finished) == [
            (0, "abort"), (1, "abort"), (2, "abort"),
        ]  # fmt: skip
        stats = loop.call(engine.stats)
        assert (stats.num_running_requests, stats.num_waiting_requests) == (0, 0)
        assert stats.num_free_blocks == stats.num_blocks
        loop.call(engine.kv.check_integrity)
    finally:
        loop.stop()


def test_generate_refuses_n_above_one(llm):
    with pytest.raises(InvalidRequestError, match="one sample per prompt: n must be 1"):
        llm.generate([PROMPT], SamplingParams(n=2))
