"""Sampling: seeds reproduce in any batch, top_k=1 is greedy, stop token ids stop."""

from __future__ import annotations

from engine import SamplingParams

PROMPT = "My favourite animal is the"


def test_seeded_sampling_is_reproducible_alone_and_in_a_batch(llm):
    params = SamplingParams(max_tokens=12, temperature=0.9, top_p=0.9, seed=1234, ignore_eos=True)
    alone = llm.generate([PROMPT], params)[0].token_ids
    again = llm.generate([PROMPT], params)[0].token_ids
    other = SamplingParams(max_tokens=12, temperature=1.0, seed=7, ignore_eos=True)
    batched = llm.generate(["Some other prompt", PROMPT], [other, params])[1].token_ids
    assert alone == again == batched
    different_seed = SamplingParams(
        max_tokens=12, temperature=0.9, top_p=0.9, seed=4321, ignore_eos=True
    )
    assert llm.generate([PROMPT], different_seed)[0].token_ids != alone


def test_top_k_one_is_greedy(llm):
    greedy = llm.generate([PROMPT], SamplingParams(max_tokens=8, temperature=0.0))[0]
    top1 = llm.generate([PROMPT], SamplingParams(max_tokens=8, temperature=1.3, top_k=1))[0]
    assert top1.token_ids == greedy.token_ids


def test_stop_token_ids_end_generation_without_text(llm):
    greedy = llm.generate(["1, 2, 3, 4,"], SamplingParams(max_tokens=12, temperature=0.0))[0]
    assert greedy.token_ids[:3] == [216, 37, 28]  # " 5,"
    out = llm.generate(
        ["1, 2, 3, 4,"], SamplingParams(max_tokens=12, temperature=0.0, stop_token_ids=[28])
    )[0]
    assert out.token_ids == [216, 37, 28]
    assert out.text == " 5"
    assert out.finish_reason == "stop"
    assert llm.engine.pool.num_free_blocks == llm.engine.pool.num_blocks
