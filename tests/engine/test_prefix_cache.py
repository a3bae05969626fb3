"""Prefix caching: a hit gives the same tokens as a miss, and the hit is counted."""

from __future__ import annotations

from engine import LLM, SamplingParams

SHARED = "You are a careful assistant. " * 20  # ~120 tokens, several full blocks
GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


def test_prefix_hit_gives_the_same_tokens_as_a_miss():
    llm = LLM(num_threads=2, device="cpu", num_blocks=256, quantization="none")  # the fp32 path
    question = SHARED + "What is two plus two?"
    miss = llm.generate([question], GREEDY)[0]
    assert miss.num_cached_tokens == 0

    hit = llm.generate([question], GREEDY)[0]
    prompt_len = len(hit.prompt_token_ids)
    assert hit.num_cached_tokens == (prompt_len - 1) // 16 * 16
    assert hit.token_ids == miss.token_ids

    other = llm.generate([SHARED + "Name a color."], GREEDY)[0]
    common = 0
    for a, b in zip(hit.prompt_token_ids, other.prompt_token_ids, strict=False):
        if a != b:
            break
        common += 1
    assert other.num_cached_tokens == common // 16 * 16 > 0
    stats = llm.engine.stats()
    queried = 2 * prompt_len + len(other.prompt_token_ids)
    assert stats.prefix_hit_rate == (hit.num_cached_tokens + other.num_cached_tokens) / queried
    assert stats.num_free_blocks == stats.num_blocks
    llm.engine.kv.check_integrity()
