"""The int8 KV cache (--kv-cache-dtype int8): each K and V row (one token, one KV head) rotated,
then stored as int8 values with one symmetric scale, packed into the cache row next to them.

Row layout (the last dimension of the cache, int8):
    [head_dim int8 values q][2 bytes: float16 scale s]      k @ R ~= q * s,  s >= max |k @ R| / 127
so the cache stays one tensor [num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim + 2]
and one block is still one contiguous byte range: the KV transfer ships values and scales
together without knowing the format. 66 bytes a row instead of fp32's 256 (bf16's 128).

The rotation R is an orthonormal Hadamard matrix (blocks of the largest power of two that
divides head_dim; R = R^T = R^-1). Keys have a few channels far larger than the rest (RoPE's
slow frequencies), and one scale per row must cover the largest, so the rest lose precision;
rotated, every channel is a mix of all of them and the row's max is near its typical value
(max / rms of this model's keys: 5.1 plain, 2.4 rotated), so the same 8 bits round half as
coarsely (QuaRot, arXiv 2404.00456, rotates the KV cache the same way). Attention needs no
un-rotation of the cache: q.k = (q R).(k R), and softmax(.) (V R) = (softmax(.) V) R, so
attention runs on the rotated rows with a rotated query and rotates its output back
(engine/attention.py, TorchSDPABackend); only the step's new tokens are ever multiplied by R.

The scale is float16, rounded up from max / 127, and the values are divided by that stored
scale: every element is within half a step of its original, none is clipped, and the scale's
own rounding adds no error. A row's scale depends on that row only, so a token's
cached KV does not depend on what it was batched or chunked with, and a block written by a
prefill worker is the block a local prefill would have written.
"""

from __future__ import annotations

from functools import lru_cache

import torch

SCALE_DTYPE = torch.float16
SCALE_BYTES = 2  # one float16 per row
INT8_MAX = 127
# Multiplied by this before rounding to float16, max |x| / 127 rounds to a float16 at or above
# it: a float16 normal's half-ulp is at most 2^-11 of it. Scales stay within float16's normals
# (a row of zeros gets the smallest: its values are all 0).
_ROUND_UP = (1 + 2**-10) / INT8_MAX
_SCALE_MIN = torch.finfo(SCALE_DTYPE).tiny
_SCALE_MAX = torch.finfo(SCALE_DTYPE).max / (1 + 2**-10)


def row_width(head_dim: int, quantized: bool) -> int:
    """The cache's last dimension: head_dim values, plus the scale's bytes when int8."""
    return head_dim + SCALE_BYTES if quantized else head_dim


@lru_cache(maxsize=8)
def rotation(head_dim: int, device: torch.device) -> torch.Tensor:
    """R [head_dim, head_dim] float32: block-diagonal orthonormal Hadamard matrices (Sylvester's
    construction) of the largest power of two that divides head_dim. Symmetric: R @ R = I."""
    block = head_dim & -head_dim  # the largest power of two dividing head_dim
    h = torch.ones(1, 1)
    while h.shape[0] < block:
        h = torch.cat([torch.cat([h, h], dim=1), torch.cat([h, -h], dim=1)])
    h = h / block**0.5
    return torch.block_diag(*[h] * (head_dim // block)).to(device)


def rotate(x: torch.Tensor) -> torch.Tensor:
    """[..., head_dim] @ R in float32, back in x's dtype (R is its own inverse)."""
    r = rotation(x.shape[-1], x.device)
    return (x.float() @ r).to(x.dtype)


def quantize(x: torch.Tensor) -> torch.Tensor:
    """[..., head_dim] float -> [..., head_dim + 2] int8 packed rows of x @ R."""
    rotated = rotate(x.float())
    amax = rotated.abs().amax(dim=-1, keepdim=True)
    scale = (amax * _ROUND_UP).clamp_(_SCALE_MIN, _SCALE_MAX).to(SCALE_DTYPE)
    q = rotated.div_(scale.float()).round_().clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    return torch.cat([q, scale.view(torch.int8)], dim=-1)


def dequantize(packed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[..., head_dim + 2] int8 packed rows (any view whose strides are even, as every view of
    the cache is) -> [..., head_dim] in dtype: the rows as stored, i.e. still rotated (x @ R)."""
    scale = packed[..., -SCALE_BYTES:].view(SCALE_DTYPE)
    return (packed[..., :-SCALE_BYTES].float() * scale.float()).to(dtype)
