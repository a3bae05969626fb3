"""Decode steps replayed from CUDA graphs, so a step costs a few launches instead of thousands.

A graph is captured per (batch size, block-table width). A step of n decodes replays the graph
of the smallest captured batch size >= n; its padding rows decode one token each in the scratch
block (a block outside the pool, see ModelRunner), so they never touch a request's KV. Inputs go
into static buffers before each replay; the backend re-plans its static decode plan on the host
(FlashInfer's plan(), or plain buffer copies), which the replay then reads. The graph covers the
layers; the final norm, lm_head and sampling stay eager (one large matmul; logits of every
batch size would otherwise each need their own static [batch, vocab] buffer).
"""

from __future__ import annotations

import bisect
import logging
import time
from dataclasses import dataclass

import torch

from engine.attention import AttentionBackend, AttentionMetadata, StepLayout
from engine.model import LlamaModel

log = logging.getLogger(__name__)


@dataclass(slots=True)
class StaticDecodeStep:
    """One decode step over fixed buffers: what a graph captures, and what it replays."""

    batch_size: int
    width: int
    ints: torch.Tensor  # [4, batch]: input ids, positions, slot blocks, slot offsets
    plan: object  # the backend's static decode plan
    hidden: torch.Tensor | None = None  # [batch, hidden]: the captured output
    graph: torch.cuda.CUDAGraph | None = None

    def metadata(self) -> AttentionMetadata:
        return AttentionMetadata(self.ints[2], self.ints[3], self.plan)


@dataclass(frozen=True, slots=True)
class DecodeInputs:
    """A decode-only step, on the host: one token per request."""

    input_ids: list[int]
    positions: list[int]
    slot_block_ids: list[int]
    layout: StepLayout


class DecodeGraphs:
    """Owns the captured graphs of one runner. capture=False runs the very same static steps
    eagerly (no CUDA needed): that is how the CPU tests check padding and static plans."""

    def __init__(
        self, model: LlamaModel, attention: AttentionBackend, kv_storage: torch.Tensor,
        batch_sizes: tuple[int, ...], max_blocks: int, block_size: int, pad_block: int,
        capture: bool = True,
    ) -> None:  # fmt: skip
        self.model = model
        self.attention = attention
        self.kv_storage = kv_storage  # the whole cache, the scratch block included
        self.batch_sizes = tuple(sorted(set(batch_sizes)))
        self.max_blocks = max_blocks
        self.block_size = block_size
        self.pad_block = pad_block
        self.capture = capture
        self.device = kv_storage.device
        self._steps: dict[tuple[int, int], StaticDecodeStep] = {}
        self._pool = torch.cuda.graph_pool_handle() if capture else None

    @property
    def max_batch_size(self) -> int:
        return self.batch_sizes[-1]

    def batch_size_for(self, num_requests: int) -> int | None:
        i = bisect.bisect_left(self.batch_sizes, num_requests)
        return self.batch_sizes[i] if i < len(self.batch_sizes) else None

    def can_run(self, layout: StepLayout) -> bool:
        return (
            layout.is_decode_only
            and layout.num_requests <= self.max_batch_size
            and layout.max_num_blocks <= self.max_blocks
        )

    def capture_all(self) -> None:
        """Captures every batch size at the backend's first width, largest first so that the
        smaller graphs reuse the larger ones' memory in the shared pool."""
        started = time.perf_counter()
        width = self.attention.graph_width(1, self.max_blocks)
        for batch_size in reversed(self.batch_sizes):
            self._step(batch_size, width)
        log.info(
            "captured %d decode CUDA graphs (batch sizes %s, table width %d) in %.1f s",
            len(self.batch_sizes), list(self.batch_sizes), width, time.perf_counter() - started,
        )  # fmt: skip

    def run(self, inputs: DecodeInputs) -> torch.Tensor:
        """The step's hidden states [n, hidden] (before the final norm)."""
        layout = inputs.layout
        n = layout.num_requests
        batch_size = self.batch_size_for(n)
        assert batch_size is not None and self.can_run(layout), (n, layout.max_num_blocks)
        width = self.attention.graph_width(layout.max_num_blocks, self.max_blocks)
        step = self._step(batch_size, width)
        self._fill(step, inputs)
        if step.graph is not None:
            step.graph.replay()
            assert step.hidden is not None
            return step.hidden[:n]
        return self._forward(step)[:n]

    # ---- internals

    def _step(self, batch_size: int, width: int) -> StaticDecodeStep:
        key = (batch_size, width)
        step = self._steps.get(key)
        if step is None:
            step = StaticDecodeStep(
                batch_size, width,
                ints=torch.zeros(4, batch_size, dtype=torch.long, device=self.device),
                plan=self.attention.static_plan(batch_size, width),
            )  # fmt: skip
            if self.capture:
                self._capture(step)
            else:  # the same first step, eagerly
                self._fill_scratch(step)
                self._forward(step)
            self._steps[key] = step
        return step

    def _fill(self, step: StaticDecodeStep, inputs: DecodeInputs) -> None:
        n, b = inputs.layout.num_requests, step.batch_size
        num_pad = b - n
        positions = inputs.positions + [0] * num_pad
        host = torch.tensor(
            [
                inputs.input_ids + [0] * num_pad,
                positions,
                inputs.slot_block_ids + [self.pad_block] * num_pad,
                [p % self.block_size for p in positions],
            ],
            dtype=torch.long,
        )
        if self.device.type == "cuda":
            host = host.pin_memory()
        step.ints.copy_(host, non_blocking=True)
        self.attention.update_static_plan(step.plan, inputs.layout.padded(b, self.pad_block))

    def _fill_scratch(self, step: StaticDecodeStep) -> None:
        """No request: every row is a padding row, decoding in the scratch block. What warm-up
        and capture run on."""
        self._fill(step, DecodeInputs([], [], [], StepLayout([], [], [])))

    def _forward(self, step: StaticDecodeStep) -> torch.Tensor:
        ids, positions = step.ints[0], step.ints[1]
        return self.model.forward_hidden(
            ids, positions, self.kv_storage, step.metadata(), self.attention
        )

    def _capture(self, step: StaticDecodeStep) -> None:
        self._fill_scratch(step)
        # Warm up on a side stream first (lazy library init, workspace allocation), as the
        # CUDA-graph docs ask; every write of these runs lands in the scratch block.
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(2):
                self._forward(step)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # thread_local: the KV transfer threads keep issuing their own CUDA calls meanwhile.
        with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
            step.hidden = self._forward(step)
        step.graph = graph
