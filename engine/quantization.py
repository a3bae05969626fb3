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

int4: groups of 32 consecutive input columns share a scale and a min, w ~= scale * q + min with
q in [0, 15] (asymmetric min/max). That is the GGUF's own Q4_1 format, and llama.cpp's Q4_1 blocks
each reach q = 0 and q = 15 (every block of the bundled model does), so min/max recovers their
codes exactly (tests/engine/test_quantization.py checks against the raw GGUF blocks). Steps of
up to CODES_MAX_ROWS rows (decode) run the C++ kernel engine/csrc/q4_1_linear.cpp on the codes,
with float32 scales and mins and the activations rounded to int16 per 32 inputs (integer dot
products; no greedy token of the quality prompts moves); more rows (prefill chunks,
compute-bound) run oneDNN's float32 matmul on the weight as it was given, packed. On a GGUF's
weights both read the same values (docs/engine.md).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from types import ModuleType
from typing import Literal

import torch
import torch.nn.functional as F

Quantization = Literal["none", "int8", "int4"]
QUANTIZATIONS: tuple[Quantization, ...] = ("none", "int8", "int4")
INT8_MAX = 127
INT4_MAX = 15
INT4_GROUP = 32
# The C++ kernels (int4 layers, the Q8_0 head) take output rows four at a time.
CODES_ROWS_AT_ONCE = 4
# Steps of at most this many rows read the C++ kernels' codes (Int4Weight, Q8Weight); more rows
# run oneDNN's float32 matmul of the packed weight. A decode step reads every layer's weight
# once, so the codes' 0.75 bytes a weight against float32's 4 win until the step is
# compute-bound: in the engine, int4, the codes took 0.52x-0.86x of oneDNN's time a step from 6
# to 16 rows, on AVX-512 and on AVX2 alike, and broke even near 24 (`python -m
# bench.int4_rows` measures it on this machine; docs/engine.md).
CODES_MAX_ROWS = 16
# Steps of at most this many rows (decode batches) run the int8 kernel; larger ones (prefill
# chunks) dequantize the weight and run one float matmul (measured: docs/engine.md).
KERNEL_MAX_ROWS = 64
PACK_BATCH_HINT = 32
# Steps of at most this many rows read a packed weight's plain copy (PackedWeight).
PLAIN_MAX_ROWS = 2


@contextmanager
def codes_max_rows(rows: int) -> Iterator[None]:
    """Steps of up to `rows` rows read the codes kernels while the block runs (studies and
    benchmarks: the engine's own limit is CODES_MAX_ROWS)."""
    global CODES_MAX_ROWS
    engine_rows, CODES_MAX_ROWS = CODES_MAX_ROWS, rows
    try:
        yield
    finally:
        CODES_MAX_ROWS = engine_rows


def onednn_linear(x2: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    """x2 [M, K] @ weight.T for a weight packed by torch.ops.mkldnn._reorder_linear_weight."""
    return torch.ops.mkldnn._linear_pointwise(x2, packed, None, "none", [None], "")


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
    """A linear layer's weight as 4-bit codes with a float scale and min per 32 inputs, read by
    the C++ kernel engine/csrc/q4_1_linear.cpp for steps of up to CODES_MAX_ROWS rows, and as
    its float32 weight, packed for oneDNN, for more rows (a second copy of the weight). The
    kernel computes every row of x alike, so a row's result does not depend on the batch."""

    # Rows in fours, each four's groups side by side (the kernel reads a four front to back); a
    # group's 16 bytes hold its codes 0..15 in their low nibbles and 16..31 in their high ones.
    codes: torch.Tensor  # uint8 [N / 4, K / 32, 4, 16]
    scales: torch.Tensor  # float32 [N / 4, K / 32, 4]
    mins: torch.Tensor  # float32 [N / 4, K / 32, 4]
    dense: torch.Tensor  # the float32 weight, oneDNN-packed (PackedWeight.packed)
    kernel: ModuleType  # engine.cpu_kernels.load()

    def tensors(self) -> list[torch.Tensor]:
        return [self.codes, self.scales, self.mins, self.dense]

    def matmul(self, x2: torch.Tensor) -> torch.Tensor:
        if x2.shape[0] > CODES_MAX_ROWS:
            return onednn_linear(x2, self.dense)
        return self.kernel.q4_1_linear(x2, self.codes, self.scales, self.mins)


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
        return onednn_linear(x2, self.packed)


@dataclass(frozen=True, slots=True)
class Q8Weight:
    """A float32 weight that is exactly GGUF Q8_0 (int8 codes, one scale per 32 inputs: the
    bundled GGUF's token embedding, so its tied lm_head), read as those codes by the C++ kernel
    engine/csrc/q8_0_linear.cpp, for steps of up to CODES_MAX_ROWS rows: a quarter of the float32
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
        if x2.shape[0] > CODES_MAX_ROWS:
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


def in_fours(values: torch.Tensor) -> torch.Tensor:
    """[N, K / 32, ...] per-group values as [N / 4, K / 32, 4, ...]: each four rows' groups side
    by side, the C++ kernels' layout."""
    n = values.shape[0]
    fours = values.view(n // CODES_ROWS_AT_ONCE, CODES_ROWS_AT_ONCE, *values.shape[1:])
    return fours.transpose(1, 2).contiguous()


def quantize_int4(weight: torch.Tensor) -> Int4Weight | PackedWeight:
    """Group-wise asymmetric 4-bit: per group of 32 inputs, scale = (max - min) / 15 and
    q = round((w - min) / scale), so min and max are on the grid (a group of equal values gets
    scale 1). Refuses shapes and devices the kernel cannot take; without a kernel (no C++
    compiler) the layer keeps its float32 weight, packed."""
    n, k = weight.shape
    if k % INT4_GROUP or n % CODES_ROWS_AT_ONCE:
        raise ValueError(
            f"int4 needs input dims in multiples of {INT4_GROUP} and output dims in multiples "
            f"of {CODES_ROWS_AT_ONCE}, got a {n}x{k} weight"
        )
    if weight.device.type != "cpu" or weight.dtype != torch.float32:
        raise ValueError(
            f"int4 runs a float32 CPU kernel, the weight is {weight.dtype} on {weight.device}"
        )
    dense = pack(weight)
    kernel = _codes_kernel("int4 layers")
    if kernel is None or not isinstance(dense, PackedWeight):
        return dense
    q, scale, low = int4_groups(weight)
    groups = q.view(n, k // INT4_GROUP, INT4_GROUP).to(torch.uint8)
    half = INT4_GROUP // 2
    nibbles = groups[..., :half] | (groups[..., half:] << 4)
    # Only the packed copy is kept: steps that read the float weight have over 4 rows.
    return Int4Weight(in_fours(nibbles), in_fours(scale), in_fours(low), dense.packed, kernel)


def _codes_kernel(what: str) -> ModuleType | None:
    """The C++ kernels' module, or None (logged) where they cannot be built."""
    from engine import cpu_kernels

    return cpu_kernels.load_or_none(f"{what}: float32")


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
    if found is None or not isinstance(packed, PackedWeight) or len(weight) % CODES_ROWS_AT_ONCE:
        return packed
    kernel = _codes_kernel("lm_head")
    if kernel is None:
        return packed
    codes, scales = found
    groups = codes.view(len(codes), -1, INT4_GROUP)
    return Q8Weight(in_fours(groups), in_fours(scales), packed, kernel)


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
