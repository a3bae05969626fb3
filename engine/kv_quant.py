"""The int8 KV cache (--kv-cache-dtype int8): one symmetric scale per token and head, packed into
the cache row next to its values.

Row layout (the last dimension of the cache, int8):
    [head_dim int8 values q][4 bytes: float32 scale s]      k ~= q * s,  s = max |k| / 127
so the cache stays one tensor [num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim + 4]
and one block is still one contiguous byte range: the KV transfer ships values and scales
together without knowing the format. 68 bytes a row instead of fp32's 256 (bf16's 128).

A row's scale depends on that row only, so a token's cached KV does not depend on what it was
batched or chunked with, and a block written by a prefill worker is the block a local prefill
would have written.
"""

from __future__ import annotations

import torch

SCALE_BYTES = 4  # one float32 per row
INT8_MAX = 127


def row_width(head_dim: int, quantized: bool) -> int:
    """The cache's last dimension: head_dim values, plus the scale's bytes when int8."""
    return head_dim + SCALE_BYTES if quantized else head_dim


def quantize(x: torch.Tensor) -> torch.Tensor:
    """[..., head_dim] float -> [..., head_dim + 4] int8 packed rows."""
    x32 = x.float()
    amax = x32.abs().amax(dim=-1, keepdim=True)
    scale = torch.where(amax > 0, amax / INT8_MAX, torch.ones_like(amax))
    q = torch.round(x32 / scale).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    return torch.cat([q, scale.view(torch.int8)], dim=-1)


def dequantize(packed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[..., head_dim + 4] int8 packed rows (any view whose strides are multiples of 4, as every
    view of the cache is) -> [..., head_dim] in dtype."""
    scale = packed[..., -SCALE_BYTES:].view(torch.float32)
    return (packed[..., :-SCALE_BYTES].float() * scale).to(dtype)
