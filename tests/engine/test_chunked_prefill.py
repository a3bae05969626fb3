"""Chunked prefill equals one-shot prefill: logits within 1e-4 (fp32) and identical tokens."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.scheduler import ScheduledRequest

PROMPT = " ".join(f"item {i} costs {i * 3} coins;" for i in range(90))  # ~700 tokens


def last_logits(llm: LLM, prompt_ids: list[int], chunk: int) -> torch.Tensor:
    """Prefills the prompt `chunk` tokens at a time through the runner; returns the last logits."""
    engine = llm.engine
    request = engine.make_request(f"chunk-{chunk}", prompt_ids, SamplingParams(max_tokens=1))
    assert engine.kv.allocate_slots(request, request.num_tokens)
    try:
        logits = None
        while request.num_computed_tokens < request.num_tokens:
            n = min(chunk, request.num_tokens - request.num_computed_tokens)
            _, logits = engine.runner.forward([ScheduledRequest(request, n)])
            request.num_computed_tokens += n
        return logits[0]
    finally:
        engine.kv.free(request)


@pytest.mark.parametrize("chunk", [128, 512])
def test_chunked_logits_equal_one_shot(llm, chunk):
    prompt_ids = llm.tokenizer.encode(PROMPT)
    assert len(prompt_ids) > 600
    one_shot = last_logits(llm, prompt_ids, len(prompt_ids))
    chunked = last_logits(llm, prompt_ids, chunk)
    assert torch.allclose(chunked, one_shot, atol=1e-4, rtol=0)
    assert llm.engine.pool.num_free_blocks == llm.engine.pool.num_blocks


def test_chunk_sizes_give_identical_greedy_tokens(llm):
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    reference = llm.generate([PROMPT], params)[0].token_ids  # chunk 512 (the default)
    small = LLM(
        chunk_size=128,
        num_threads=2,
        device="cpu",
        enable_prefix_caching=False,
        quantization="none",
    )
    assert small.generate([PROMPT], params)[0].token_ids == reference
    assert small.engine.pool.num_free_blocks == small.engine.pool.num_blocks
