"""KVLayout: the header both ends must agree on."""

from __future__ import annotations

import pytest
import torch

from kvtransfer import KVLayout

SMOLLM2 = KVLayout("SmolLM2-135M-Instruct", "float32", 16, 30, 3, 64)


def test_bytes_per_block_is_one_block_of_every_layer_k_and_v() -> None:
    # 30 layers * (K, V) * 16 tokens * 3 heads * 64 dims * 4 bytes = 46,080 B/token * 16 tokens
    assert SMOLLM2.bytes_per_block == 737_280
    bf16 = KVLayout("SmolLM2-135M-Instruct", "bfloat16", 16, 30, 3, 64)
    assert bf16.bytes_per_block == 368_640
    # int8 rows: 64 values and their float16 scale (engine/kv_quant.py), 11,880 B/token.
    int8 = KVLayout("SmolLM2-135M-Instruct", "int8", 16, 30, 3, 64)
    assert int8.bytes_per_block == 190_080


def test_of_reads_an_int8_cache_whose_rows_carry_their_scale() -> None:
    cache = torch.zeros((5, 30, 2, 16, 3, 66), dtype=torch.int8)
    layout = KVLayout.of("SmolLM2-135M-Instruct", cache)
    assert (layout.dtype, layout.head_dim) == ("int8", 64)
    assert cache[1].numel() * cache.element_size() == layout.bytes_per_block


def test_of_reads_shape_and_dtype_of_a_block_major_cache() -> None:
    cache = torch.zeros((5, 30, 2, 16, 3, 64), dtype=torch.float32)
    assert KVLayout.of("SmolLM2-135M-Instruct", cache) == SMOLLM2
    assert cache[1].numel() * cache.element_size() == SMOLLM2.bytes_per_block


@pytest.mark.parametrize(
    "shape",
    [(5, 30, 16, 3, 64), (5, 30, 3, 16, 3, 64)],  # no K/V axis; K/V axis of 3
)
def test_of_rejects_a_cache_that_is_not_block_major(shape: tuple[int, ...]) -> None:
    with pytest.raises(ValueError, match="kv_cache must be"):
        KVLayout.of("m", torch.zeros(shape))


def test_mismatch_names_every_differing_field() -> None:
    other = KVLayout("SmolLM2-135M-Instruct", "bfloat16", 8, 30, 3, 64)
    assert SMOLLM2.mismatch(SMOLLM2) is None
    assert SMOLLM2.mismatch(other) == (
        "dtype: expected float32, got bfloat16; block_size: expected 16, got 8"
    )


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({**SMOLLM2.to_dict(), "dtype": "int4"}, "dtype must be one of"),
        ({**SMOLLM2.to_dict(), "head_dim": 0}, "head_dim must be a positive int"),
        ({"model_id": "m"}, "malformed KV layout"),
    ],
)
def test_from_dict_rejects_malformed_peer_layouts(data: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        KVLayout.from_dict(data)
    assert KVLayout.from_dict(SMOLLM2.to_dict()) == SMOLLM2
