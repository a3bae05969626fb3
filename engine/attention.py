"""Attention over the paged KV cache: the step layout every backend plans from, the backend
interface, torch SDPA (CPU and any device), and a paged backend's self-check against SDPA
(which backend runs: engine/attention_choice.py).

KV cache memory map (one tensor per worker, block-major so that one block of every layer is
one contiguous byte range, which is what the KV transfer moves):
    kv_cache: [num_blocks, num_layers, 2 (K, V), block_size, num_kv_heads, head_dim]
A layer's view kv_cache[:, i] is [num_blocks, 2, block_size, num_kv_heads, head_dim] with a page
stride of num_layers pages: the paged kernels (FlashInfer, flash-attn) read it in place.
An int8 cache (--kv-cache-dtype int8) has rows of head_dim + 2 bytes, rotated values then their
scale (engine/kv_quant.py); only SDPA reads it, dequantizing what it gathers.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import ClassVar

import torch
import torch.nn.functional as F

from engine import kv_quant


@dataclass(frozen=True, slots=True)
class AttentionSpec:
    """What a backend is built for: the model's heads, the cache's pages, dtype and device."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype
    device: torch.device
    kv_quantized: bool = False  # an int8 cache of packed rows (engine/kv_quant.py)

    @property
    def group_size(self) -> int:
        return self.num_heads // self.num_kv_heads


@dataclass(frozen=True, slots=True)
class StepLayout:
    """Host-side shape of one step, built once by the runner. Request i's queries are the step's
    tokens [query_starts[i], query_starts[i] + query_lens[i]); after the step its KV holds
    context_lens[i] tokens (the new ones included) in block_tables[i]."""

    query_lens: list[int]
    context_lens: list[int]
    block_tables: list[list[int]]  # ceil(context_len / block_size) blocks each
    query_starts: list[int] = field(init=False)

    def __post_init__(self) -> None:
        starts, total = [], 0
        for n in self.query_lens:
            starts.append(total)
            total += n
        object.__setattr__(self, "query_starts", starts)

    @property
    def num_requests(self) -> int:
        return len(self.query_lens)

    def is_decode(self, i: int) -> bool:
        """One new token after existing context: the single-query path."""
        return self.query_lens[i] == 1 and self.context_lens[i] > 1

    @property
    def is_decode_only(self) -> bool:
        return all(self.is_decode(i) for i in range(self.num_requests))

    @property
    def max_num_blocks(self) -> int:
        return max((len(t) for t in self.block_tables), default=0)

    def padded(self, batch_size: int, pad_block: int) -> StepLayout:
        """The layout with decode rows appended up to batch_size: each reads and writes one slot
        of pad_block, a block outside the pool, so padding never touches a request's KV."""
        num_pad = batch_size - self.num_requests
        assert num_pad >= 0, (batch_size, self.num_requests)
        return StepLayout(
            self.query_lens + [1] * num_pad,
            self.context_lens + [1] * num_pad,
            self.block_tables + [[pad_block]] * num_pad,
        )


@dataclass(frozen=True, slots=True)
class AttentionMetadata:
    """What every layer reads: where the step's new K/V go, and the backend's plan."""

    slot_block_ids: torch.Tensor  # [T] block of each new token's KV
    slot_offsets: torch.Tensor  # [T] offset inside that block
    plan: object  # the backend's own per-step state (built once, read by every layer)


class BackendUnusableError(RuntimeError):
    """A backend cannot serve this spec here (missing package, dtype, page size, failed check)."""


def require_cuda_half(spec: AttentionSpec) -> None:
    """What every paged CUDA kernel library here needs: a CUDA device and bf16/fp16."""
    if spec.device.type != "cuda":
        raise BackendUnusableError(f"needs a CUDA device, not {spec.device}")
    if spec.dtype not in (torch.bfloat16, torch.float16):
        raise BackendUnusableError(f"kernels are bf16/fp16 only, dtype is {spec.dtype}")
    if spec.kv_quantized:
        raise BackendUnusableError("the paged kernels do not read an int8 KV cache (sdpa does)")


class AttentionBackend(ABC):
    """One call per layer covers the whole step; plan() does the per-step host work once."""

    name: ClassVar[str]

    def __init__(self, spec: AttentionSpec) -> None:
        self.spec = spec

    @abstractmethod
    def plan(self, layout: StepLayout) -> object:
        """Per-step state for forward(), built once per step on the host."""

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,  # [T, num_heads, head_dim], RoPE applied
        layer_cache: torch.Tensor,  # [num_blocks, 2, block_size, num_kv_heads, head_dim]
        plan: object,
        new_k: torch.Tensor,  # [T, num_kv_heads, head_dim], already written to layer_cache
        new_v: torch.Tensor,
    ) -> torch.Tensor:  # [T, num_heads, head_dim]
        ...

    # ---- CUDA graphs: a decode plan whose tensors stay at one address between replays

    def graph_width(self, num_blocks: int, max_blocks: int) -> int:
        """Block-table width of the captured graph that a decode step needing num_blocks per
        request replays. Paged kernels read each row only up to its length: one width."""
        return max_blocks

    @abstractmethod
    def static_plan(self, batch_size: int, width: int) -> object:
        """A decode plan for exactly batch_size rows and block tables of this width."""

    @abstractmethod
    def update_static_plan(self, plan: object, layout: StepLayout) -> None:
        """Rewrite a static plan in place for this (already padded) decode layout."""


def write_kv(
    layer_cache: torch.Tensor, meta: AttentionMetadata, k: torch.Tensor, v: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Stores the step's new K/V; returns them as the cache now holds them (an int8 cache:
    dequantized, still rotated). Attention reads those, never the unquantized ones, so with an
    int8 cache a fresh prompt, a chunk after cached context and a decode all see the same keys
    (chunked == one-shot, hit == miss)."""
    if layer_cache.dtype != torch.int8:
        layer_cache[meta.slot_block_ids, 0, meta.slot_offsets] = k
        layer_cache[meta.slot_block_ids, 1, meta.slot_offsets] = v
        return k, v
    # K and V side by side: one quantization, one dequantization (a decode step's dozen small
    # ops a layer would otherwise run twice).
    packed = kv_quant.quantize(torch.stack([k, v]))
    layer_cache[meta.slot_block_ids, 0, meta.slot_offsets] = packed[0]
    layer_cache[meta.slot_block_ids, 1, meta.slot_offsets] = packed[1]
    k, v = kv_quant.dequantize(packed, k.dtype)
    return k, v


def read_kv(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Gathered cache rows -> K or V in the model's dtype (int8 rows are dequantized)."""
    return kv_quant.dequantize(rows, dtype) if rows.dtype == torch.int8 else rows


def gather_kv(
    layer_cache: torch.Tensor, block_table: torch.Tensor, num_tokens: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns one request's first num_tokens K and V: [num_tokens, num_kv_heads, head_dim].
    K and V are gathered apart, each in one copy that comes out with its blocks' tokens
    consecutive (gathering whole blocks, then splitting K from V, copied everything twice)."""
    # [nb, bs, Hkv, D] (D + 2 bytes when int8), contiguous: flatten is a view.
    k = layer_cache[:, 0][block_table].flatten(0, 1)[:num_tokens]
    v = layer_cache[:, 1][block_table].flatten(0, 1)[:num_tokens]
    return read_kv(k, dtype), read_kv(v, dtype)


def to_device(values: Sequence | torch.Tensor, device: torch.device, dtype=torch.long):
    """Host ints -> device tensor. On CUDA the copy goes through pinned memory, non-blocking,
    so building a step's metadata never waits for the GPU to drain."""
    host = values if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=dtype)
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


# ---- torch SDPA -------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class PrefillSegment:
    """A run of query tokens of one request: tokens [token_start, token_end) of this step are
    its positions [context_start, context_start + n)."""

    token_start: int
    token_end: int
    context_start: int
    block_table: torch.Tensor  # [num_blocks_of_request] int64


def plan_prefills(layout: StepLayout, device: torch.device) -> list[PrefillSegment]:
    """The step's prompt chunks (every request that is not a single-token decode)."""
    segments = []
    for i, start in enumerate(layout.query_starts):
        if not layout.is_decode(i):
            n, context = layout.query_lens[i], layout.context_lens[i]
            table = to_device(layout.block_tables[i], device)
            segments.append(PrefillSegment(start, start + n, context - n, table))
    return segments


def decode_rows(layout: StepLayout) -> list[int]:
    """Indices of the step's requests that are single-token decodes."""
    return [i for i in range(layout.num_requests) if layout.is_decode(i)]


def attend_prefills(
    out: torch.Tensor,
    q: torch.Tensor,
    layer_cache: torch.Tensor,
    prefills: list[PrefillSegment],
    new_k: torch.Tensor,
    new_v: torch.Tensor,
) -> None:
    """SDPA over each prompt chunk, one at a time, written into out's rows for it."""
    for seg in prefills:
        n = seg.token_end - seg.token_start
        # SDPA's fast CPU kernel takes 4-D [batch, heads, tokens, dim] only; 3-D input falls
        # back to the unfused math path (5x slower at 1,024 tokens).
        q_seg = _heads_first(q[seg.token_start : seg.token_end])
        if seg.context_start == 0:
            # Whole context is this chunk: attend to the fresh K/V, plain causal mask.
            k = _heads_first(new_k[seg.token_start : seg.token_end])
            v = _heads_first(new_v[seg.token_start : seg.token_end])
            o = F.scaled_dot_product_attention(q_seg, k, v, is_causal=True, enable_gqa=True)
        else:
            total = seg.context_start + n
            k, v = gather_kv(layer_cache, seg.block_table, total, q.dtype)
            # Bottom-right causal: query i sits at position context_start + i.
            rows = torch.arange(n, device=q.device).unsqueeze(1) + seg.context_start
            mask = torch.arange(total, device=q.device).unsqueeze(0) <= rows
            o = F.scaled_dot_product_attention(
                q_seg, _heads_first(k), _heads_first(v), attn_mask=mask, enable_gqa=True
            )
        out[seg.token_start : seg.token_end] = o[0].transpose(0, 1)


@dataclass(frozen=True, slots=True)
class SDPAPlan:
    prefills: list[PrefillSegment]
    decode_token_ids: torch.Tensor  # [B] which of the T tokens are single-token decodes
    decode_block_tables: torch.Tensor  # [B, max_blocks] padded (the mask hides the padding)
    decode_mask: torch.Tensor | None  # [B, 1, 1, max_blocks * block_size] True = attend
    num_decodes: int  # B, known on the host


class TorchSDPABackend(AttentionBackend):
    """Prefill segments one at a time; all decode tokens of the step in one padded SDPA call.
    Decode gathers each request's blocks: exact everywhere, the fallback on CUDA and on a CPU
    where the in-place decode kernel cannot be built (engine/cpu_paged_backend.py)."""

    name = "sdpa"

    def plan(self, layout: StepLayout) -> SDPAPlan:
        device, bs = self.spec.device, self.spec.block_size
        prefills, decodes = plan_prefills(layout, device), decode_rows(layout)
        decode_tables = [layout.block_tables[i] for i in decodes]
        max_blocks = max((len(t) for t in decode_tables), default=0)
        # Padding points at block 0; the mask hides it.
        tables = [t + [0] * (max_blocks - len(t)) for t in decode_tables]
        mask = None
        if decodes:
            lens = torch.tensor([layout.context_lens[i] for i in decodes], dtype=torch.long)
            mask = torch.arange(max_blocks * bs).unsqueeze(0) < lens.unsqueeze(1)
            mask = to_device(mask[:, None, None, :], device)
        return SDPAPlan(
            prefills=prefills,
            decode_token_ids=to_device([layout.query_starts[i] for i in decodes], device),
            decode_block_tables=to_device(tables, device)
            if tables
            else torch.empty(0, 0, dtype=torch.long, device=device),
            decode_mask=mask,
            num_decodes=len(decodes),
        )

    def forward(self, q, layer_cache, plan, new_k, new_v):
        if self.spec.kv_quantized:
            # An int8 cache holds K @ R and V @ R (engine/kv_quant.py): (q R).(k R) = q.k, and
            # the output comes out rotated too; R is its own inverse.
            out = self._attend(kv_quant.rotate(q), layer_cache, plan, new_k, new_v)
            return kv_quant.rotate(out)
        return self._attend(q, layer_cache, plan, new_k, new_v)

    def _attend(self, q, layer_cache, plan, new_k, new_v):
        out = torch.empty_like(q)
        attend_prefills(out, q, layer_cache, plan.prefills, new_k, new_v)
        if plan.num_decodes:
            # Gather K and V separately: each comes out as one copy, already [B, L, Hkv, D].
            tables = plan.decode_block_tables
            k = read_kv(layer_cache[:, 0][tables], q.dtype).flatten(1, 2).transpose(1, 2)
            v = read_kv(layer_cache[:, 1][tables], q.dtype).flatten(1, 2).transpose(1, 2)
            # k, v: [B, Hkv, L, D]
            q_dec = q[plan.decode_token_ids].unsqueeze(2)  # [B, H, 1, D]
            o = F.scaled_dot_product_attention(
                q_dec, k, v, attn_mask=plan.decode_mask, enable_gqa=True
            )
            out[plan.decode_token_ids] = o.squeeze(2)
        return out

    def graph_width(self, num_blocks: int, max_blocks: int) -> int:
        # The gather reads the whole table width: widths grow in powers of two, so a short
        # context never pays for the longest one (one graph per batch size and width).
        width = 16
        while width < num_blocks:
            width *= 2
        return min(width, max_blocks)

    def static_plan(self, batch_size: int, width: int) -> SDPAPlan:
        device, bs = self.spec.device, self.spec.block_size
        return SDPAPlan(
            prefills=[],
            decode_token_ids=torch.arange(batch_size, device=device),
            decode_block_tables=torch.zeros(batch_size, width, dtype=torch.long, device=device),
            decode_mask=torch.zeros(batch_size, 1, 1, width * bs, dtype=torch.bool, device=device),
            num_decodes=batch_size,
        )

    def update_static_plan(self, plan: SDPAPlan, layout: StepLayout) -> None:
        width = plan.decode_block_tables.shape[1]
        # Past each row's own blocks the table repeats its last block; the mask hides them.
        tables = [t + [t[-1]] * (width - len(t)) for t in layout.block_tables]
        lens = torch.tensor(layout.context_lens, dtype=torch.long)
        positions = torch.arange(width * self.spec.block_size).unsqueeze(0)
        plan.decode_block_tables.copy_(to_device(tables, plan.decode_block_tables.device))
        mask = (positions < lens.unsqueeze(1))[:, None, None, :]
        plan.decode_mask.copy_(to_device(mask, plan.decode_mask.device))


def _heads_first(x: torch.Tensor) -> torch.Tensor:
    """[n, heads, dim] -> [1, heads, n, dim]."""
    return x.transpose(0, 1).unsqueeze(0)


# ---- self-check -------------------------------------------------------------------------------


def check_against_sdpa(backend: AttentionBackend, atol: float) -> None:
    """Start-up self-check of a paged backend: one mixed step (a fresh prefill, a chunk after
    cached context, a decode) and one decode-only step on a strided cache like the real one,
    compared with SDPA. Raises BackendUnusableError on any difference above atol, so a kernel
    that is wrong on this machine is never served."""
    spec = backend.spec
    reference = TorchSDPABackend(spec)
    generator = torch.Generator(device="cpu").manual_seed(0)
    num_blocks, bs = 8, spec.block_size
    # Two layers: the layer view has the real cache's non-contiguous page stride.
    shape = (num_blocks, 2, 2, bs, spec.num_kv_heads, spec.head_dim)
    cache = torch.randn(shape, generator=generator).to(spec.device, spec.dtype)
    layer = cache[:, 1]
    layouts = [
        StepLayout(
            [5, 3, 1], [5, bs + 3, 2 * bs + 1], [[0], [1, 2], [3, 4, 5]]
        ),  # fresh prefill, chunk after cache, decode
        StepLayout([1, 1], [bs + 1, 3 * bs], [[6, 7], [3, 4, 5]]),  # decode only
    ]
    for layout in layouts:
        num_tokens = sum(layout.query_lens)
        q = torch.randn(num_tokens, spec.num_heads, spec.head_dim, generator=generator)
        q = q.to(spec.device, spec.dtype)
        # The fresh K/V of each request's queries, as the model passes them (already in cache).
        new_k, new_v = _fresh_kv(layer, layout, bs)
        got = backend.forward(q, layer, backend.plan(layout), new_k, new_v)
        want = reference.forward(q, layer, reference.plan(layout), new_k, new_v)
        error = (got.float() - want.float()).abs().max().item()
        if not error <= atol:
            raise BackendUnusableError(
                f"self-check against SDPA failed: max abs error {error:.3g} > {atol} "
                f"(layout {layout.query_lens}/{layout.context_lens})"
            )


def _fresh_kv(layer: torch.Tensor, layout: StepLayout, bs: int):
    ks, vs = [], []
    for i, n in enumerate(layout.query_lens):
        context = layout.context_lens[i]
        table = torch.tensor(layout.block_tables[i], device=layer.device)
        k, v = gather_kv(layer, table, context, layer.dtype)
        ks.append(k[context - n :])
        vs.append(v[context - n :])
    return torch.cat(ks), torch.cat(vs)
