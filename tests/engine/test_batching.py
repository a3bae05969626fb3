"""Batched equals alone: a batch of ragged prompts gives each prompt's solo tokens."""

from __future__ import annotations

from engine import SamplingParams

PROMPTS = [
    "Hi",
    "The three laws of motion are",
    "List the planets of the solar system in order from the sun:" * 4,
    "Write a haiku about autumn leaves falling slowly onto a quiet pond at dusk.",
]


def test_ragged_batch_matches_each_prompt_alone(llm):
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    llm.engine.pool.reset_cache()  # no prefix hits from earlier tests: same path for both
    batched = llm.generate(PROMPTS, params)
    for prompt, out in zip(PROMPTS, batched, strict=True):
        llm.engine.pool.reset_cache()
        alone = llm.generate([prompt], params)[0]
        assert out.token_ids == alone.token_ids, prompt
        assert len(out.token_ids) == 16
    assert llm.engine.pool.num_free_blocks == llm.engine.pool.num_blocks
