"""Attention backends over the paged KV cache: torch SDPA (CPU, any device) and flash-attn (CUDA).

KV cache memory map (one tensor per worker, block-major so that one block of every layer is
one contiguous byte range, which is what the KV transfer moves):
    kv_cache: [num_blocks, num_layers, 2 (K, V), block_size, num_kv_heads, head_dim]
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class PrefillSegment:
    """A run of query tokens of one request: tokens [token_start, token_end) of this step are
    its positions [context_start, context_start + n)."""

    token_start: int
    token_end: int
    context_start: int
    block_table: torch.Tensor  # [num_blocks_of_request] int64


@dataclass(frozen=True, slots=True)
class AttentionMetadata:
    slot_block_ids: torch.Tensor  # [T] block of each new token's KV
    slot_offsets: torch.Tensor  # [T] offset inside that block
    prefills: list[PrefillSegment]
    decode_token_ids: torch.Tensor  # [B] which of the T tokens are single-token decodes
    decode_block_tables: torch.Tensor  # [B, max_blocks] padded with block 0
    decode_context_lens: torch.Tensor  # [B] tokens of context, the new one included
    decode_mask: torch.Tensor | None  # [B, 1, 1, max_blocks * block_size] True = attend


class AttentionBackend(ABC):
    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,  # [T, num_heads, head_dim], RoPE applied
        layer_cache: torch.Tensor,  # [num_blocks, 2, block_size, num_kv_heads, head_dim]
        meta: AttentionMetadata,
        new_k: torch.Tensor,  # [T, num_kv_heads, head_dim], already written to layer_cache
        new_v: torch.Tensor,
    ) -> torch.Tensor:  # [T, num_heads, head_dim]
        ...


def write_kv(layer_cache: torch.Tensor, meta: AttentionMetadata, k: torch.Tensor, v: torch.Tensor):
    layer_cache[meta.slot_block_ids, 0, meta.slot_offsets] = k
    layer_cache[meta.slot_block_ids, 1, meta.slot_offsets] = v


def gather_kv(
    layer_cache: torch.Tensor, block_table: torch.Tensor, num_tokens: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns one request's first num_tokens K and V: [num_tokens, num_kv_heads, head_dim]."""
    blocks = layer_cache[block_table]  # [nb, 2, bs, Hkv, D]
    k = blocks[:, 0].flatten(0, 1)[:num_tokens]
    v = blocks[:, 1].flatten(0, 1)[:num_tokens]
    return k, v


class TorchSDPABackend(AttentionBackend):
    """Prefill segments one at a time; all decode tokens of the step in one padded SDPA call."""

    def forward(self, q, layer_cache, meta, new_k, new_v):
        out = torch.empty_like(q)
        for seg in meta.prefills:
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
                k, v = gather_kv(layer_cache, seg.block_table, total)
                # Bottom-right causal: query i sits at position context_start + i.
                rows = torch.arange(n, device=q.device).unsqueeze(1) + seg.context_start
                mask = torch.arange(total, device=q.device).unsqueeze(0) <= rows
                o = F.scaled_dot_product_attention(
                    q_seg, _heads_first(k), _heads_first(v), attn_mask=mask, enable_gqa=True
                )
            out[seg.token_start : seg.token_end] = o[0].transpose(0, 1)
        if meta.decode_token_ids.numel():
            # Gather K and V separately: each comes out as one copy, already [B, L, Hkv, D].
            tables = meta.decode_block_tables
            k = layer_cache[:, 0][tables].flatten(1, 2).transpose(1, 2)  # [B, Hkv, L, D]
            v = layer_cache[:, 1][tables].flatten(1, 2).transpose(1, 2)
            q_dec = q[meta.decode_token_ids].unsqueeze(2)  # [B, H, 1, D]
            o = F.scaled_dot_product_attention(
                q_dec, k, v, attn_mask=meta.decode_mask, enable_gqa=True
            )
            out[meta.decode_token_ids] = o.squeeze(2)
        return out


def _heads_first(x: torch.Tensor) -> torch.Tensor:
    """[n, heads, dim] -> [1, heads, n, dim]."""
    return x.transpose(0, 1).unsqueeze(0)


class FlashAttnBackend(AttentionBackend):
    """CUDA path: gathers each request's context and runs one varlen flash-attn call for the
    whole step. (flash-attn's own paged kernel needs pages of 256 tokens; ours are smaller.)"""

    def __init__(self) -> None:
        from flash_attn import flash_attn_varlen_func

        self.varlen = flash_attn_varlen_func

    def forward(self, q, layer_cache, meta, new_k, new_v):
        queries, keys, values, q_lens, k_lens = [], [], [], [], []
        for seg in meta.prefills:
            n = seg.token_end - seg.token_start
            k, v = gather_kv(layer_cache, seg.block_table, seg.context_start + n)
            queries.append(q[seg.token_start : seg.token_end])
            keys.append(k)
            values.append(v)
            q_lens.append(n)
            k_lens.append(seg.context_start + n)
        for row, token in enumerate(meta.decode_token_ids.tolist()):
            total = int(meta.decode_context_lens[row])
            k, v = gather_kv(layer_cache, meta.decode_block_tables[row], total)
            queries.append(q[token : token + 1])
            keys.append(k)
            values.append(v)
            q_lens.append(1)
            k_lens.append(total)
        device = q.device
        cu_q = F.pad(torch.tensor(q_lens, device=device).cumsum(0), (1, 0)).to(torch.int32)
        cu_k = F.pad(torch.tensor(k_lens, device=device).cumsum(0), (1, 0)).to(torch.int32)
        # causal=True aligns the mask bottom-right, as a query chunk after a cached prefix needs.
        o = self.varlen(
            torch.cat(queries), torch.cat(keys), torch.cat(values), cu_q, cu_k,
            max(q_lens), max(k_lens), causal=True,
        )  # fmt: skip
        order = [t for seg in meta.prefills for t in range(seg.token_start, seg.token_end)]
        order += meta.decode_token_ids.tolist()
        out = torch.empty_like(q)
        out[torch.tensor(order, device=device)] = o
        return out


def select_backend(name: str, device: torch.device) -> AttentionBackend:
    if name in ("auto", "flash_attn") and device.type == "cuda":
        try:
            return FlashAttnBackend()
        except ImportError as e:
            if name == "flash_attn":
                raise
            log.info("flash_attn not importable (%s): using torch SDPA", e)
    elif name == "flash_attn":
        raise ValueError(f"attention_backend flash_attn needs a CUDA device, not {device}")
    return TorchSDPABackend()
