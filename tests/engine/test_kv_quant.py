"""The int8 KV cache (--kv-cache-dtype int8): packed rows, deterministic and batch-, chunk- and
prefix-cache-independent tokens (its top-1 agreement with fp32 is in test_quantization.py)."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams, kv_quant
from engine.config import EngineConfig
from engine.errors import InvalidRequestError
from engine.quality import PROMPTS
from engine.quantization import int8_last_dim

PARAMS = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def int8_kv_llm():
    return LLM(
        num_threads=2, device="cpu", kv_cache_dtype="int8", chunk_size=128, quantization="none"
    )


def test_rows_pack_rotated_values_and_their_scale():
    torch.manual_seed(0)
    x = torch.randn(5, 3, 64)
    x[1, 2] = 0.0  # a row of zeros must not divide by zero
    packed = kv_quant.quantize(x)
    assert packed.dtype == torch.int8 and packed.shape == (5, 3, 66)
    scale = packed[..., 64:].contiguous().view(torch.float16).float()  # [5, 3, 1]
    rotated = x @ kv_quant.rotation(64, x.device)
    # A row of zeros gets float16's smallest normal scale, and all-zero values.
    assert scale[1, 2].item() == torch.finfo(torch.float16).tiny
    # The smallest float16 at or above max |x R| / 127: the largest value lands on q = 127.
    exact = rotated.abs().amax(-1, keepdim=True) / 127
    assert scale[0, 0, 0] >= exact[0, 0, 0] and packed[0, 0, :64].abs().max().item() in (126, 127)
    assert (scale.half().float() == scale).all()
    restored = kv_quant.dequantize(packed, torch.float32)
    # Rounding to the nearest of 255 levels of the stored scale: off by at most half a step.
    assert (restored - rotated).abs().le(scale / 2 + 1e-7).all()
    assert torch.equal(restored[1, 2], torch.zeros(64))
    torch.testing.assert_close(kv_quant.rotate(restored), x, atol=0.02, rtol=0)


@pytest.mark.parametrize("head_dim", [64, 96, 128])
def test_the_rotation_is_an_orthonormal_hadamard_matrix_and_its_own_inverse(head_dim):
    r = kv_quant.rotation(head_dim, torch.device("cpu"))
    block = head_dim & -head_dim  # 64, 32 (96 = 3 blocks of 32), 128
    assert torch.equal(r.abs()[:block, :block], torch.full((block, block), block**-0.5))
    assert torch.equal(r, r.T)
    torch.testing.assert_close(r @ r, torch.eye(head_dim), atol=1e-6, rtol=0)
    if block < head_dim:
        assert torch.equal(r[:block, block:], torch.zeros(block, head_dim - block))


def test_rotation_rounds_keys_with_outlier_channels_finer():
    """The reason for the rotation: a row whose few large channels set its scale (as RoPE's
    slow channels do in keys) loses the rest to rounding; rotated, the same 8 bits do better."""
    torch.manual_seed(0)
    keys = torch.randn(256, 3, 64)
    keys[..., :4] *= 8.0  # four outlier channels
    plain = int8_last_dim(keys)
    rotated = kv_quant.rotate(kv_quant.dequantize(kv_quant.quantize(keys), torch.float32))
    plain_error = (plain - keys).pow(2).mean().sqrt()
    rotated_error = (rotated - keys).pow(2).mean().sqrt()
    assert rotated_error < plain_error / 2


def test_unknown_kv_cache_dtype_is_refused():
    with pytest.raises(InvalidRequestError, match="kv_cache_dtype must be auto or int8, got 'fp8'"):
        EngineConfig(kv_cache_dtype="fp8")


def test_the_cache_is_int8_rows_with_their_scales(int8_kv_llm, llm):
    cache = int8_kv_llm.engine.kv_cache
    assert cache.dtype == torch.int8 and cache.shape[1:] == (30, 2, 16, 3, 66)
    bytes_per_block = cache[0].numel() * cache.element_size()
    assert bytes_per_block == 190_080  # 11,880 B/token: 33/128 of fp32's 46,080
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
