"""Weight-only int8 quantization of the decoder's linear layers (--quantization int8).

Each weight [N, K] becomes int8 values and one symmetric scale per output channel (row):
w ~= q * scale, q in [-127, 127]. The matmul is torch's maintained CPU/CUDA kernel
torch._weight_int8pack_mm(x, q, scales), which dequantizes inside the kernel: decode at small
batch is bound by reading the weights, and int8 reads a quarter of fp32's bytes.

The kernel runs its activations in bfloat16 (float16 models keep float16): on the CPU it is
vectorized for bfloat16 only (AVX-512), its float32 path is scalar and ~50x slower. The layer's
input is cast down and its output cast back to the model's dtype, so the rest of the model
(norms, RoPE, attention, the residual stream) keeps its precision. Each row of a batch is
computed independently of the others (no per-batch activation scale), so a request's tokens do
not depend on what it is batched with.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F

Quantization = Literal["none", "int8"]
QUANTIZATIONS: tuple[Quantization, ...] = ("none", "int8")
INT8_MAX = 127
# Steps of at most this many rows (decode batches) run the int8 kernel; larger ones (prefill
# chunks) dequantize the weight and run one float matmul (measured: docs/engine.md).
KERNEL_MAX_ROWS = 64


@dataclass(frozen=True, slots=True)
class Int8Weight:
    """A linear layer's weight as int8 rows and their scales, for torch._weight_int8pack_mm."""

    qweight: torch.Tensor  # int8 [N, K]
    scales: torch.Tensor  # [N], in the kernel's activation dtype
    out_dtype: torch.dtype  # the model's dtype: what the layer returns

    def tensors(self) -> list[torch.Tensor]:
        return [self.qweight, self.scales]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())


def kernel_dtype(dtype: torch.dtype) -> torch.dtype:
    """The activation dtype the int8 kernel runs in for a model of this dtype."""
    return torch.float16 if dtype == torch.float16 else torch.bfloat16


def quantize_int8(weight: torch.Tensor) -> Int8Weight:
    """Per-output-channel symmetric int8: scale = max |w_row| / 127 (rows of zeros get 1).

    The scale is rounded to the kernel's dtype first, up to the next representable value where
    rounding went down, and the weights are divided by that rounded scale: every element is then
    within half a quantization step of its original, and none is clipped."""
    w = weight.float()
    amax = w.abs().amax(dim=1)
    exact = torch.where(amax > 0, amax / INT8_MAX, torch.ones_like(amax))
    scales = exact.to(kernel_dtype(weight.dtype))
    low = scales.float() < exact
    scales = torch.where(low, torch.nextafter(scales, torch.full_like(scales, torch.inf)), scales)
    q = torch.round(w / scales.float()[:, None]).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    return Int8Weight(q.contiguous(), scales, weight.dtype)


def linear(
    x: torch.Tensor, weight: torch.Tensor | Int8Weight, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """F.linear for a plain weight; the int8 kernel for a quantized one."""
    if isinstance(weight, torch.Tensor):
        return F.linear(x, weight, bias)
    rows = x.numel() // x.shape[-1]
    if rows > KERNEL_MAX_ROWS:
        # A prefill chunk is compute-bound: the int8 kernel is slower there than one matmul
        # of the dequantized weight (whose cost is amortized over the rows), and the rows
        # keep the model's precision.
        dequantized = (
            weight.qweight.to(weight.out_dtype) * weight.scales.to(weight.out_dtype)[:, None]
        )
        return F.linear(x, dequantized, bias)
    shape = x.shape
    x2 = x.reshape(-1, shape[-1]).to(weight.scales.dtype)
    y = torch._weight_int8pack_mm(x2, weight.qweight, weight.scales).to(weight.out_dtype)
    y = y.view(*shape[:-1], y.shape[-1])
    return y if bias is None else y + bias


def weight_tensors(weight: torch.Tensor | Int8Weight) -> list[torch.Tensor]:
    return [weight] if isinstance(weight, torch.Tensor) else weight.tensors()
