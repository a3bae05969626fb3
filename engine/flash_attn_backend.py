"""flash-attn attention (CUDA): its paged kernels read the KV cache in place through block tables.

A step with any prefill is one flash_attn_varlen_func(block_table=...) call per layer (causal,
bottom-right aligned, so a chunk after cached context and a decode are both just rows); a
decode-only step is one flash_attn_with_kvcache(block_table=..., cache_seqlens=...) call.
flash-attn 2's paged kernels need pages of a multiple of 256 tokens (block_size 256, 512...).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.attention import (
    AttentionBackend,
    AttentionSpec,
    BackendUnusableError,
    StepLayout,
    check_against_sdpa,
    require_cuda_half,
    to_device,
)

PAGE_MULTIPLE = 256


@dataclass(frozen=True, slots=True)
class _DecodePlan:
    cache_seqlens: torch.Tensor  # [B] int32
    block_table: torch.Tensor  # [B, width] int32


@dataclass(frozen=True, slots=True)
class _VarlenPlan:
    cu_seqlens_q: torch.Tensor  # [B + 1] int32
    cu_seqlens_k: torch.Tensor  # [B + 1] int32
    max_seqlen_q: int
    max_seqlen_k: int
    block_table: torch.Tensor  # [B, max_blocks] int32


class FlashAttnBackend(AttentionBackend):
    name = "flash_attn"

    def __init__(self, spec: AttentionSpec) -> None:
        super().__init__(spec)
        require_cuda_half(spec)
        if spec.block_size % PAGE_MULTIPLE:
            raise BackendUnusableError(
                f"paged kernels need block_size % {PAGE_MULTIPLE} == 0, block_size is "
                f"{spec.block_size}"
            )
        try:
            from flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache
        except ImportError as e:
            raise BackendUnusableError(f"not importable ({e})") from e
        self._varlen = flash_attn_varlen_func
        self._with_kvcache = flash_attn_with_kvcache
        try:
            check_against_sdpa(self, atol=3e-2)
        except BackendUnusableError:
            raise
        except Exception as e:  # a kernel that does not launch here
            raise BackendUnusableError(f"kernels do not run here: {type(e).__name__}: {e}") from e

    def _tables(self, layout: StepLayout, width: int) -> torch.Tensor:
        # Past a row's blocks the table repeats its last block; the kernel stops at the length.
        rows = [t + [t[-1]] * (width - len(t)) for t in layout.block_tables]
        return torch.tensor(rows, dtype=torch.int32)

    def plan(self, layout: StepLayout) -> _DecodePlan | _VarlenPlan:
        device = self.spec.device
        table = to_device(self._tables(layout, layout.max_num_blocks), device)
        if layout.is_decode_only:
            lens = to_device(layout.context_lens, device, torch.int32)
            return _DecodePlan(lens, table)
        cu_q = torch.tensor([*layout.query_starts, sum(layout.query_lens)], dtype=torch.int32)
        cu_k = torch.tensor([0, *layout.context_lens], dtype=torch.int32).cumsum(0)
        return _VarlenPlan(
            to_device(cu_q, device), to_device(cu_k.to(torch.int32), device),
            max(layout.query_lens), max(layout.context_lens), table,
        )  # fmt: skip

    def forward(self, q, layer_cache, plan, new_k, new_v):
        k_cache, v_cache = layer_cache[:, 0], layer_cache[:, 1]  # [num_blocks, bs, Hkv, D]
        q = q.contiguous()  # a view of the fused q|k RoPE output (engine/model.py)
        if isinstance(plan, _DecodePlan):
            out = self._with_kvcache(
                q.unsqueeze(1), k_cache, v_cache, cache_seqlens=plan.cache_seqlens,
                block_table=plan.block_table, causal=True,
            )  # fmt: skip
            return out.squeeze(1)
        return self._varlen(
            q, k_cache, v_cache, plan.cu_seqlens_q, plan.cu_seqlens_k, plan.max_seqlen_q,
            plan.max_seqlen_k, causal=True, block_table=plan.block_table,
        )  # fmt: skip

    def static_plan(self, batch_size: int, width: int) -> _DecodePlan:
        device = self.spec.device
        return _DecodePlan(
            torch.ones(batch_size, dtype=torch.int32, device=device),
            torch.zeros(batch_size, width, dtype=torch.int32, device=device),
        )

    def update_static_plan(self, plan: _DecodePlan, layout: StepLayout) -> None:
        device = self.spec.device
        plan.cache_seqlens.copy_(to_device(layout.context_lens, device, torch.int32))
        plan.block_table.copy_(to_device(self._tables(layout, plan.block_table.shape[1]), device))
