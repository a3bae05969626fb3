"""Greedy fp32 output is token-identical to Hugging Face transformers on the same weights."""

from __future__ import annotations

import torch

from engine import SamplingParams

NUM_NEW_TOKENS = 32


def prompts(tokenizer) -> list[str]:
    long_story = " ".join(
        f"Chapter {i}: the river carried the boat past village number {i * 7}, where the "
        "fishermen sang about the weather, the harvest and the old lighthouse keeper."
        for i in range(48)
    )
    return [
        "The capital of France is",
        tokenizer.apply_chat_template([{"role": "user", "content": "Name three primary colors."}]),
        "请用一句话介绍长城。",
        "def fibonacci(n):\n    ",
        "1, 1, 2, 3, 5, 8, 13,",
        long_story + "\nSummary:",
    ]


def hf_greedy(hf_model, prompt_ids: list[int]) -> list[int]:
    with torch.inference_mode():
        out = hf_model.generate(
            torch.tensor([prompt_ids]),
            attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
            max_new_tokens=NUM_NEW_TOKENS,
            do_sample=False,
            pad_token_id=2,
        )
    return out[0, len(prompt_ids) :].tolist()


def test_greedy_fp32_matches_transformers(llm, hf_model):
    texts = prompts(llm.tokenizer)
    params = SamplingParams(max_tokens=NUM_NEW_TOKENS, temperature=0.0, ignore_eos=True)
    outputs = llm.generate(texts, params)  # all six batched, the long one chunked

    assert len(outputs[-1].prompt_token_ids) > 1200
    for text, out in zip(texts, outputs, strict=True):
        assert out.prompt_token_ids == llm.tokenizer.encode(text)
        assert out.finish_reason == "length"
        assert out.token_ids == hf_greedy(hf_model, out.prompt_token_ids), text[:40]
    assert llm.engine.pool.num_free_blocks == llm.engine.pool.num_blocks
