"""The int8 KV cache (--kv-cache-dtype int8): packed rows, deterministic and batch-, chunk- and
prefix-cache-independent tokens (its top-1 agreement with fp32 is in test_quantization.py)."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams, kv_quant
from engine.config import EngineConfig
from engine.errors import InvalidRequestError
from tests.engine.test_quantization import PROMPTS

PARAMS = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def int8_kv_llm():
    return LLM(num_threads=2, kv_cache_dtype="int8", chunk_size=128)


def test_rows_pack_values_and_their_scale():
    torch.manual_seed(0)
    x = torch.randn(5, 3, 64)
    x[1, 2] = 0.0  # a row of zeros must not divide by zero
    packed = kv_quant.quantize(x)
    assert packed.dtype == torch.int8 and packed.shape == (5, 3, 68)
    scale = packed[..., 64:].contiguous().view(torch.float32)  # [5, 3, 1]
    assert torch.equal(scale[1, 2], torch.ones(1))
    torch.testing.assert_close(scale[0, 0, 0], x[0, 0].abs().max() / 127)
    restored = kv_quant.dequantize(packed, torch.float32)
    # Rounding to the nearest of 255 levels: off by at most half a step per element.
    assert (restored - x).abs().le(scale / 2 + 1e-7).all()
    assert torch.equal(restored[1, 2], torch.zeros(64))


def test_unknown_kv_cache_dtype_is_refused():
    with pytest.raises(InvalidRequestError, match="kv_cache_dtype must be auto or int8, got 'fp8'"):
        EngineConfig(kv_cache_dtype="fp8")


def test_the_cache_is_int8_rows_with_their_scales(int8_kv_llm, llm):
    cache = int8_kv_llm.engine.kv_cache
    assert cache.dtype == torch.int8 and cache.shape[1:] == (30, 2, 16, 3, 68)
    bytes_per_block = cache[0].numel() * cache.element_size()
    assert bytes_per_block == 195_840  # 12,240 B/token: 17/64 of fp32's 46,080
    assert llm.engine.kv_cache[0].numel() * 4 == 737_280


def test_int8_kv_is_deterministic_and_independent_of_batch_chunks_and_cache(int8_kv_llm):
    engine = int8_kv_llm.engine
    long = " ".join(f"Step {i}: add {i} grams of flour and stir." for i in range(40))
    prompts = [*PROMPTS[:3], long]  # the long one: three chunks of 128
    engine.pool.reset_cache()
    batched = [o.token_ids for o in int8_kv_llm.generate(prompts, PARAMS)]
    for prompt, expected in zip(prompts, batched, strict=True):
        engine.pool.reset_cache()
        assert int8_kv_llm.generate([prompt], PARAMS)[0].token_ids == expected, prompt
        # Again with its prompt's blocks in the prefix cache: the hit reads the same int8 KV.
        hit = int8_kv_llm.generate([prompt], PARAMS)[0]
        assert hit.token_ids == expected
    assert hit.num_cached_tokens > 0
    assert engine.pool.num_free_blocks == engine.pool.num_blocks
