"""FlashInfer attention (CUDA): paged prefill and decode kernels reading the KV cache in place.

One wrapper plan per step (host work), one kernel call per layer for the whole batch: a step
with any prefill runs the paged prefill kernel over every request (decodes are queries of
length 1; causal masks align bottom-right), a decode-only step runs the decode kernel.
FlashInfer JIT-compiles its kernels with nvcc on first use and caches them under
$FLASHINFER_WORKSPACE_BASE/.cache/flashinfer (the chart points it at the /cache volume).
Install on GPU hosts only: pip install flashinfer-python==0.7.2.post1 (docs/engine.md).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from engine.attention import (
    AttentionBackend,
    AttentionSpec,
    BackendUnusableError,
    StepLayout,
    check_against_sdpa,
    require_cuda_half,
)

log = logging.getLogger(__name__)

WORKSPACE_BYTES = 128 << 20  # FlashInfer's recommended split-k scratch, shared by all wrappers
# Group sizes the CUDA-core decode kernel is instantiated for; other groups (and large ones,
# where tensor cores win) decode through the prefill kernel with one query row per request.
_CUDA_CORE_GROUPS = (1, 2, 3, 4)


@dataclass(frozen=True, slots=True)
class _Plan:
    wrapper: object  # the planned BatchPrefill/BatchDecodeWithPagedKVCacheWrapper


@dataclass(frozen=True, slots=True)
class _PageTable:
    """FlashInfer's CSR page table (host int32): request i's pages are
    indices[indptr[i]:indptr[i+1]], the last of them holding last_page_len[i] tokens."""

    indptr: torch.Tensor
    indices: torch.Tensor
    last_page_len: torch.Tensor

    @classmethod
    def of(cls, layout: StepLayout, block_size: int) -> _PageTable:
        indptr, indices, last = [0], [], []
        for table, context in zip(layout.block_tables, layout.context_lens, strict=True):
            indices.extend(table)
            indptr.append(len(indices))
            last.append(context - (len(table) - 1) * block_size)
        as_int32 = _host_int32
        return cls(as_int32(indptr), as_int32(indices), as_int32(last))


def _host_int32(values: list[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32)


class FlashInferBackend(AttentionBackend):
    name = "flashinfer"

    def __init__(self, spec: AttentionSpec) -> None:
        super().__init__(spec)
        require_cuda_half(spec)
        try:
            import flashinfer
        except ImportError as e:
            raise BackendUnusableError(f"not importable ({e}): see docs/engine.md") from e
        self._fi = flashinfer
        self._workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=spec.device)
        self._use_tensor_cores = spec.group_size not in _CUDA_CORE_GROUPS
        self._planned: torch.cuda.Event | None = None
        self._prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(self._workspace, "NHD")
        self._decode = self._decode_wrapper()
        log.info(
            "FlashInfer %s: compiling or loading its kernels (JIT with nvcc; the first run on a "
            "host takes minutes, then the cache serves them)", flashinfer.__version__,
        )  # fmt: skip
        try:
            check_against_sdpa(self, atol=3e-2)
        except BackendUnusableError:
            raise
        except Exception as e:  # a JIT build or kernel launch failure, of FlashInfer's own types
            raise BackendUnusableError(f"kernels do not run here: {type(e).__name__}: {e}") from e

    def _decode_wrapper(self, buffers: tuple[torch.Tensor, ...] | None = None):
        kwargs = {"use_tensor_cores": self._use_tensor_cores}
        if buffers is not None:
            indptr, indices, last = buffers
            kwargs.update(
                use_cuda_graph=True, paged_kv_indptr_buffer=indptr,
                paged_kv_indices_buffer=indices, paged_kv_last_page_len_buffer=last,
            )  # fmt: skip
        return self._fi.BatchDecodeWithPagedKVCacheWrapper(self._workspace, "NHD", **kwargs)

    def _plan_kwargs(self) -> dict:
        s = self.spec
        return {"q_data_type": s.dtype, "kv_data_type": s.dtype}

    def _before_plan(self) -> None:
        """A wrapper's plan() refills one pinned host buffer and copies it to the GPU without
        blocking. A step that samples nothing ends without a sync, so the host can run a step
        ahead: wait until the previous plan's copy has run before overwriting its source."""
        if self._planned is not None:
            self._planned.synchronize()
        self._planned = None

    def _after_plan(self) -> None:
        self._planned = torch.cuda.Event()
        self._planned.record(torch.cuda.current_stream(self.spec.device))

    def plan(self, layout: StepLayout) -> _Plan:
        self._before_plan()
        try:
            return self._plan(layout)
        finally:
            self._after_plan()

    def _plan(self, layout: StepLayout) -> _Plan:
        s = self.spec
        pages = _PageTable.of(layout, s.block_size)
        if layout.is_decode_only:
            self._decode.plan(
                pages.indptr, pages.indices, pages.last_page_len, s.num_heads, s.num_kv_heads,
                s.head_dim, s.block_size, **self._plan_kwargs(),
            )  # fmt: skip
            return _Plan(self._decode)
        qo_indptr = _host_int32([*layout.query_starts, sum(layout.query_lens)])
        self._prefill.plan(
            qo_indptr, pages.indptr, pages.indices, pages.last_page_len, s.num_heads,
            s.num_kv_heads, s.head_dim, s.block_size, causal=True, **self._plan_kwargs(),
        )  # fmt: skip
        return _Plan(self._prefill)

    def forward(self, q, layer_cache, plan, new_k, new_v):
        # layer_cache [num_blocks, 2, bs, Hkv, D] is FlashInfer's NHD single-tensor format; its
        # page stride (num_layers pages) is passed to the kernel as a stride, no copy.
        # q arrives as a view of the fused q|k RoPE output (engine/model.py): made dense here.
        return plan.wrapper.run(q.contiguous(), layer_cache)

    # ---- CUDA graphs: one decode wrapper per captured batch size, on fixed buffers

    def static_plan(self, batch_size: int, width: int) -> _Plan:
        device = self.spec.device
        buffers = (
            torch.zeros(batch_size + 1, dtype=torch.int32, device=device),
            torch.zeros(batch_size * width, dtype=torch.int32, device=device),
            torch.zeros(batch_size, dtype=torch.int32, device=device),
        )
        return _Plan(self._decode_wrapper(buffers))

    def update_static_plan(self, plan: _Plan, layout: StepLayout) -> None:
        # plan() is host work and buffer copies, outside the graph; the replay reads the
        # buffers (and the plan info in the workspace), never host values captured earlier.
        s = self.spec
        pages = _PageTable.of(layout, s.block_size)
        self._before_plan()
        plan.wrapper.plan(
            pages.indptr, pages.indices, pages.last_page_len, s.num_heads, s.num_kv_heads,
            s.head_dim, s.block_size, **self._plan_kwargs(),
        )  # fmt: skip
        self._after_plan()
