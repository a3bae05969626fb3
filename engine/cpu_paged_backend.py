"""Paged decode attention on the CPU: decode tokens read the KV cache in place through their
block tables (engine/csrc/paged_decode_attention.cpp), so a decode step's cost follows the bytes
of its context; prompt chunks run SDPA as in the sdpa backend.

SDPA's decode gathers every request's blocks into a padded copy, masks the padding and expands
the KV heads for grouped queries, on every layer of every step: at 2,048 tokens of context that
is several times the bytes the step needs. The kernel walks the blocks, scores each KV head's
group of query heads against its K rows where they lie and keeps an online softmax in float.

The kernel is C++ (engine/cpu_kernels.py builds it); a machine without a C++ compiler falls
back to sdpa with a warning.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine import cpu_kernels
from engine.attention import (
    AttentionSpec,
    BackendUnusableError,
    PrefillSegment,
    StepLayout,
    TorchSDPABackend,
    attend_prefills,
    check_against_sdpa,
    decode_rows,
    plan_prefills,
)


@dataclass(frozen=True, slots=True)
class CPUPagedPlan:
    prefills: list[PrefillSegment]
    decode_token_ids: torch.Tensor  # [B] which of the T tokens are single-token decodes
    block_tables: torch.Tensor  # [B, max_blocks] int32; row i valid up to context_lens[i]
    context_lens: torch.Tensor  # [B] int32
    num_decodes: int


class CPUPagedBackend(TorchSDPABackend):
    name = "cpu_paged"

    def __init__(self, spec: AttentionSpec) -> None:
        super().__init__(spec)
        if spec.device.type != "cpu":
            raise BackendUnusableError(f"runs on the CPU, not {spec.device}")
        if spec.kv_quantized:
            raise BackendUnusableError("reads a float KV cache; an int8 one decodes through sdpa")
        try:
            self._kernel = cpu_kernels.load()
        except (ImportError, OSError, RuntimeError) as e:  # no compiler, ninja or headers
            raise BackendUnusableError(f"the C++ kernel did not build: {e}") from e
        check_against_sdpa(self, atol=1e-4 if spec.dtype == torch.float32 else 3e-2)

    def plan(self, layout: StepLayout) -> CPUPagedPlan:
        rows = decode_rows(layout)
        tables = [layout.block_tables[i] for i in rows]
        width = max((len(t) for t in tables), default=0)
        return CPUPagedPlan(
            prefills=plan_prefills(layout, self.spec.device),
            decode_token_ids=torch.tensor([layout.query_starts[i] for i in rows]),
            # Rows past their own blocks are never read: pad with block 0.
            block_tables=torch.tensor(
                [t + [0] * (width - len(t)) for t in tables], dtype=torch.int32
            ).view(len(rows), width),
            context_lens=torch.tensor([layout.context_lens[i] for i in rows], dtype=torch.int32),
            num_decodes=len(rows),
        )

    def forward(self, q, layer_cache, plan, new_k, new_v):
        if plan.num_decodes == q.shape[0]:  # a decode-only step: every row is the kernel's
            return self._kernel.paged_decode_attention(
                q, layer_cache, plan.block_tables, plan.context_lens
            )
        out = torch.empty_like(q)
        attend_prefills(out, q, layer_cache, plan.prefills, new_k, new_v)
        if plan.num_decodes:
            rows = plan.decode_token_ids
            out[rows] = self._kernel.paged_decode_attention(
                q[rows], layer_cache, plan.block_tables, plan.context_lens
            )
        return out

    def static_plan(self, batch_size: int, width: int) -> CPUPagedPlan:
        raise NotImplementedError("CUDA graphs exist on CUDA only")

    def update_static_plan(self, plan: CPUPagedPlan, layout: StepLayout) -> None:
        raise NotImplementedError("CUDA graphs exist on CUDA only")
