"""Weight-only quantization of the decoder's linear layers (--quantization int8 | int4).

int8: each weight [N, K] becomes int8 values and one symmetric scale per output channel (row):
w ~= q * scale, q in [-127, 127]. The matmul is torch's maintained CPU/CUDA kernel
torch._weight_int8pack_mm(x, q, scales), which dequantizes inside the kernel: decode at small
batch is bound by reading the weights, and int8 reads a quarter of fp32's bytes.

The kernel runs its activations in bfloat16 (float16 models keep float16): on the CPU it is
vectorized for bfloat16 only (AVX-512), its float32 path is scalar and ~50x slower. The layer's
input is cast down and its output cast back to the model's dtype, so the rest of the model
(norms, RoPE, attention, the residual stream) keeps its precision. Each row of a batch is
computed independently of the others (no per-batch activation scale), so a request's tokens do
not depend on what it is batched with.

int4: groups of 32 consecutive input columns share a scale and a zero, w ~= scale * q + min with
q in [0, 15] (asymmetric min/max). That is the GGUF's own Q4_1 format, and llama.cpp's Q4_1 blocks
each reach q = 0 and q = 15 (every block of the bundled model does), so min/max recovers their
codes exactly (tests/engine/test_quantization.py checks against the raw GGUF blocks). The matmul
is torch's CPU kernel torch._weight_int4pack_mm_for_cpu, which computes
w = (q - 8) * scale + zero per group, with scales_and_zeros [K / 32, N, 2] in the activation
dtype: bfloat16, like int8 (its float32 and float16 paths are scalar, 20-50x slower), so the
GGUF's float16 scales are rounded to bfloat16. It runs every step, prefill too: dequantizing
measured no faster at 128-512 rows (docs/engine.md).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from types import ModuleType
from typing import Literal

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

Quantization = Literal["none", "int8", "int4"]
QUANTIZATIONS: tuple[Quantization, ...] = ("none", "int8", "int4")
INT8_MAX = 127
INT4_MAX = 15
INT4_GROUP = 32
# The kernel's zero is the weight at q = 8 (the middle of 0..15), not at q = 0.
INT4_MIDDLE = 8
# torch's int4 pack needs the output dimension in multiples of 16.
INT4_ROWS_MULTIPLE = 16
# Steps of at most this many rows (decode batches) run the int8 kernel; larger ones (prefill
# chunks) dequantize the weight and run one float matmul (measured: docs/engine.md).
KERNEL_MAX_ROWS = 64
PACK_BATCH_HINT = 32
# Steps of at most this many rows read a packed weight's plain copy (PackedWeight).
PLAIN_MAX_ROWS = 2
# Steps of at most this many rows read a Q8_0 head's codes (Q8Weight), whose kernel takes
# output rows four at a time.
Q8_MAX_ROWS = 4
Q8_ROWS_AT_ONCE = 4


@dataclass(frozen=True, slots=True)
class Int8Weight:
    """A linear layer's weight as int8 rows and their scales, for torch._weight_int8pack_mm."""

    qweight: torch.Tensor  # int8 [N, K]
    scales: torch.Tensor  # [N], in the kernel's activation dtype
    out_dtype: torch.dtype  # the model's dtype: what the layer returns

    def tensors(self) -> list[torch.Tensor]:
        return [self.qweight, self.scales]

    def matmul(self, x2: torch.Tensor) -> torch.Tensor:
        """x2 [M, K] @ weight.T in the model's dtype."""
        if x2.shape[0] > KERNEL_MAX_ROWS:
            # A prefill chunk is compute-bound: the int8 kernel is slower there than one matmul
            # of the dequantized weight (whose cost is amortized over the rows), and the rows
            # keep the model's precision.
            dequantized = self.qweight.to(self.out_dtype) * self.scales.to(self.out_dtype)[:, None]
            return F.linear(x2, dequantized)
        y = torch._weight_int8pack_mm(x2.to(self.scales.dtype), self.qweight, self.scales)
        return y.to(self.out_dtype)


@dataclass(frozen=True, slots=True)
class Int4Weight:
    """A linear layer's weight as torch's packed int4 codes and per-group scales and zeros."""

    packed: torch.Tensor  # uint8 [N, K / 2], torch._convert_weight_to_int4pack_for_cpu's layout
    scales_and_zeros: torch.Tensor  # [K / 32, N, 2], in the kernel's activation dtype
    out_dtype: torch.dtype

    def tensors(self) -> list[torch.Tensor]:
        return [self.packed, self.scales_and_zeros]

    def matmul(self, x2: torch.Tensor) -> torch.Tensor:
        x2 = x2.to(self.scales_and_zeros.dtype).contiguous()
        y = torch._weight_int4pack_mm_for_cpu(x2, self.packed, INT4_GROUP, self.scales_and_zeros)
        return y.to(self.out_dtype)


@dataclass(frozen=True, slots=True)
class PackedWeight:
    """A float32 CPU weight, plain and reordered once into oneDNN's blocked layout for oneDNN's
    matmul (torch.ops.mkldnn._linear_pointwise: what inductor's CPU freezing runs). Against the
    plain weight's best path, over this model's shapes on 2 threads, oneDNN measured 1.1-2.4x
    faster from 8 rows to 512 (decode batches, prefill chunks) but 20-30% slower for one row
    (engine batch 1: 24-25 tok/s against 29-37), so steps of up to PLAIN_MAX_ROWS rows keep the
    plain weight: a second copy of the weight (docs/engine.md)."""

    plain: torch.Tensor  # [N, K]
    packed: torch.Tensor  # the same, as an opaque oneDNN tensor

    def tensors(self) -> list[torch.Tensor]:
        return [self.plain, self.packed]

    def matmul(self, x2: torch.Tensor) -> torch.Tensor:
        rows = x2.shape[0]
        if rows <= PLAIN_MAX_ROWS:
            return _small_linear(x2, self.plain, None, rows)
        return torch.ops.mkldnn._linear_pointwise(x2, self.packed, None, "none", [None], "")


@dataclass(frozen=True, slots=True)
class Q8Weight:
    """A float32 weight that is exactly GGUF Q8_0 (int8 codes, one scale per 32 inputs: the
    bundled GGUF's token embedding, so its tied lm_head), read as those codes by the C++ kernel
    engine/csrc/q8_0_linear.cpp, for steps of up to Q8_MAX_ROWS rows: a quarter of the float32
    bytes, the same values. More rows are compute-bound, and oneDNN's float32 matmul of the
    packed weight is faster there (like PackedWeight's plain copy, a second copy of the
    weight; docs/engine.md)."""

    # Rows in fours, each four's groups side by side (the kernel reads a four front to back):
    codes: torch.Tensor  # int8 [N / 4, K / 32, 4, 32]
    scales: torch.Tensor  # float32 [N / 4, K / 32, 4]
    packed: PackedWeight
    kernel: ModuleType  # engine.cpu_kernels.load()

    def tensors(self) -> list[torch.Tensor]:
        return [self.codes, self.scales, *self.packed.tensors()]

    def matmul(self, x2: torch.Tensor) -> torch.Tensor:
        if x2.shape[0] > Q8_MAX_ROWS:
            return self.packed.matmul(x2)
        return self.kernel.q8_0_linear(x2, self.codes, self.scales)


PreparedWeight = Int8Weight | Int4Weight | PackedWeight | Q8Weight


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


def int8_last_dim(x: torch.Tensor) -> torch.Tensor:
    """x rounded to int8 with one symmetric scale per row of its last dimension, returned
    dequantized (float): the plain rounding that bench/quant_quality.py's what-ifs and the KV
    rotation test's baseline compare against."""
    scale = (x.abs().amax(dim=-1, keepdim=True) / INT8_MAX).clamp_min(1e-12)
    return torch.round(x / scale).clamp(-INT8_MAX, INT8_MAX) * scale


def int4_groups(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Min/max 4-bit codes of a [N, K] weight: q int32 [N, K] in [0, 15], and float32 scale
    and min [N, K / 32] with w ~= scale * q + min (Q4_1's d, m and q for a GGUF's weights)."""
    n, k = weight.shape
    groups = weight.float().view(n, k // INT4_GROUP, INT4_GROUP)
    low, high = groups.amin(dim=-1), groups.amax(dim=-1)
    scale = torch.where(high > low, (high - low) / INT4_MAX, torch.ones_like(low))
    q = torch.round((groups - low[..., None]) / scale[..., None]).clamp_(0, INT4_MAX)
    return q.view(n, k).to(torch.int32), scale, low


def quantize_int4(weight: torch.Tensor) -> Int4Weight:
    """Group-wise asymmetric 4-bit: per group of 32 inputs, scale = (max - min) / 15 and
    q = round((w - min) / scale), so min and max are on the grid (a group of equal values gets
    scale 1). Refuses shapes torch's kernel cannot pack."""
    n, k = weight.shape
    if k % INT4_GROUP or n % INT4_ROWS_MULTIPLE:
        raise ValueError(
            f"int4 needs input dims in multiples of {INT4_GROUP} and output dims in multiples "
            f"of {INT4_ROWS_MULTIPLE}, got a {n}x{k} weight"
        )
    if weight.device.type != "cpu":
        raise ValueError(f"int4 runs torch's CPU kernel only, the weight is on {weight.device}")
    q, scale, low = int4_groups(weight)
    packed = torch._convert_weight_to_int4pack_for_cpu(q, 1)
    zero = low + INT4_MIDDLE * scale  # w = scale * q + low = scale * (q - 8) + zero
    scales_and_zeros = torch.stack([scale, zero], dim=-1).transpose(0, 1).contiguous()
    return Int4Weight(packed, scales_and_zeros.to(kernel_dtype(weight.dtype)), weight.dtype)


def pack(weight: torch.Tensor) -> torch.Tensor | PackedWeight:
    """A float32 CPU weight packed for oneDNN where torch has it; any other weight as it is."""
    if (
        weight.device.type != "cpu"
        or weight.dtype != torch.float32
        or not torch.backends.mkldnn.is_available()
    ):
        return weight
    # The batch-size hint only steers oneDNN's layout choice; measured the same at 1, 32, 512.
    return PackedWeight(weight, torch.ops.mkldnn._reorder_linear_weight(weight, PACK_BATCH_HINT))


def q8_0_codes(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """A [N, K] float32 weight's Q8_0 codes int8 [N, K] and scales float32 [N, K / 32] when it
    is exactly Q8_0 (every group of 32 is scale * code, as a GGUF's dequantized Q8_0 tensor is:
    llama.cpp's scale is the group's max |w| / 127), else None."""
    n, k = weight.shape
    if k % INT4_GROUP or weight.dtype != torch.float32:
        return None
    groups = weight.view(n, k // INT4_GROUP, INT4_GROUP)
    amax = groups.abs().amax(dim=-1)
    scales = torch.where(amax > 0, amax / INT8_MAX, torch.ones_like(amax))
    codes = torch.round(groups / scales[..., None])
    if not torch.equal(codes * scales[..., None], groups):
        return None
    return codes.to(torch.int8).view(n, k), scales


def prepare_head(weight: torch.Tensor, quantization: Quantization) -> torch.Tensor | PreparedWeight:
    """The lm_head's form: with quantized layers on the CPU, a head whose float32 weight is
    exactly Q8_0 reads its codes (Q8Weight; the bundled model's 113 MB head becomes 32 MB a
    decode step); otherwise the model's own weight, packed (pack)."""
    if quantization == "none" or weight.device.type != "cpu":
        return pack(weight)
    packed, found = pack(weight), q8_0_codes(weight)
    if found is None or not isinstance(packed, PackedWeight) or len(weight) % Q8_ROWS_AT_ONCE:
        return packed
    from engine import cpu_kernels

    try:
        kernel = cpu_kernels.load()
    except (ImportError, OSError, RuntimeError) as e:  # no compiler, ninja or headers
        log.warning("lm_head: float32 (the Q8_0 kernel did not build: %s)", e)
        return packed
    codes, scales = found
    n, k = codes.shape
    codes = codes.view(n // Q8_ROWS_AT_ONCE, Q8_ROWS_AT_ONCE, k // INT4_GROUP, INT4_GROUP)
    scales = scales.view(n // Q8_ROWS_AT_ONCE, Q8_ROWS_AT_ONCE, k // INT4_GROUP)
    return Q8Weight(
        codes.transpose(1, 2).contiguous(), scales.transpose(1, 2).contiguous(), packed, kernel
    )


def prepare(weight: torch.Tensor, quantization: Quantization) -> torch.Tensor | PreparedWeight:
    """The weight in the form its matmul reads: int8 / int4 codes, else packed (pack)."""
    if quantization == "int8":
        return quantize_int8(weight)
    if quantization == "int4":
        return quantize_int4(weight)
    return pack(weight)


def linear(
    x: torch.Tensor, weight: torch.Tensor | PreparedWeight, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """F.linear for a plain weight; the kernel of its form for a prepared one (prepare)."""
    if isinstance(weight, torch.Tensor):
        rows = x.numel() // x.shape[-1]
        if rows > KERNEL_MAX_ROWS or x.device.type != "cpu":
            return F.linear(x, weight, bias)
        return _small_linear(x, weight, bias, rows)
    shape = x.shape
    y = weight.matmul(x.reshape(-1, shape[-1]))
    y = y.view(*shape[:-1], y.shape[-1])
    return y if bias is None else y + bias


def _small_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, rows: int
) -> torch.Tensor:
    """A decode step's linear on the CPU as weight @ x^T. For a few rows MKL's x @ weight^T
    (what F.linear runs) takes a slow path: measured on this machine over the model's weights,
    2 rows 84-218 ms vs 18-40, 4 rows 81-935 vs 26-36, 32 rows 96 vs 88-93 (docs/engine.md).
    One row is padded to two: F.linear sends it to gemv, which read the weights at ~10 GB/s on
    1 or 2 threads, against 17-19 GB/s for the padded GEMM on 1 thread and 25-33 GB/s on 2 (the
    machine's read bandwidth is ~34 GB/s). On cores that other processes hold, any 2-thread
    kernel waits for its slower thread at every join, gemv's step included (docs/engine.md)."""
    x2 = x.reshape(rows, x.shape[-1])
    if rows == 1:
        x2 = F.pad(x2, (0, 0, 0, 1))
    y = torch.mm(weight, x2.t()).t()[:rows]
    if bias is not None:
        y = y + bias
    return y.reshape(*x.shape[:-1], weight.shape[0])


def weight_tensors(weight: torch.Tensor | PreparedWeight) -> list[torch.Tensor]:
    return [weight] if isinstance(weight, torch.Tensor) else weight.tensors()
