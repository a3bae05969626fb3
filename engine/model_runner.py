"""The model runner: owns the weights and the KV cache tensor on the engine's device; turns a
scheduled batch into one forward pass (a CUDA-graph replay for decode steps on CUDA) and the
sampled next tokens."""

from __future__ import annotations

import logging
import math
import mmap
import os
import threading
from dataclasses import dataclass
from pathlib import Path

import torch
from prometheus_client import Gauge

from engine.attention import AttentionMetadata, AttentionSpec, StepLayout, to_device
from engine.attention_choice import select_backend
from engine.config import EngineConfig, ModelConfig
from engine.cuda_graphs import DecodeGraphs, DecodeInputs
from engine.kv_quant import row_width
from engine.kv_tier import HostKVTier, host_tier
from engine.loader import load_weights
from engine.model import LlamaModel
from engine.request import Request
from engine.sampling import sample
from engine.scheduler import ScheduledRequest

log = logging.getLogger(__name__)

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# Where a worker's tensors actually live, read off the tensors themselves after loading: the
# check that --device / PDSERVE_DEVICE reached the weights and the KV cache.
ENGINE_TENSORS = Gauge(
    "pdserve_engine_tensors_info", "Device and dtype of the engine's weights and KV cache (1)",
    ["device", "dtype", "tensor"],
)  # fmt: skip
ENGINE_ATTENTION = Gauge(
    "pdserve_engine_attention_info", "Attention backend and CUDA graphs in use (1)",
    ["backend", "cuda_graphs"],
)  # fmt: skip


def zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A tensor of zeros. On the CPU it is an anonymous mapping, which the OS fills with zero
    pages as they are first written: a KV pool costs memory and time as its blocks are used,
    where torch.zeros writes every byte up front (~0.5-1 s for the default pool, on every
    engine start)."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    mapping = mmap.mmap(-1, math.prod(shape) * dtype.itemsize)
    return torch.frombuffer(mapping, dtype=dtype).view(shape)


def _dtype_name(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


@dataclass(frozen=True, slots=True)
class _Step:
    """One step's inputs on the host."""

    input_ids: list[int]
    positions: list[int]
    slot_block_ids: list[int]  # the block each new token's KV goes to
    logit_rows: list[int]  # tokens whose logits give a next token
    sampled: list[Request]
    layout: StepLayout


class ModelRunner:
    def __init__(
        self, config: EngineConfig, model_config: ModelConfig, model_dir: Path | None,
        *, weights: dict[str, torch.Tensor] | None = None,
    ) -> None:  # fmt: skip
        """weights (HF names, in dtype on the device) replace loading model_dir's files: the
        GPU benchmark builds random ones of a Llama shape without writing them to disk."""
        self.config = config
        self._threads_set_on: int | None = None  # the OS thread num_threads was applied on
        self.device = torch.device(config.device)
        self.dtype = TORCH_DTYPES[config.dtype]
        if weights is None:
            assert model_dir is not None, "a model directory or the weights"
            weights = load_weights(model_dir, self.dtype, self.device)
        self.model = LlamaModel(
            model_config, weights, self.dtype, self.device, quantization=config.quantization
        )
        mc = model_config
        # One block past the pool: the scratch block, where padded decode rows of a CUDA graph
        # read and write. The pool, the engine and the KV transfer only see kv_cache.
        int8_kv = config.kv_cache_dtype == "int8"
        self._kv_storage = zeros(
            (config.num_blocks + 1, mc.num_layers, 2, config.block_size, mc.num_kv_heads,
             row_width(mc.head_dim, int8_kv)), torch.int8 if int8_kv else self.dtype, self.device,
        )  # fmt: skip
        self.kv_cache = self._kv_storage[: config.num_blocks]
        self.scratch_block = config.num_blocks
        spec = AttentionSpec(
            mc.num_heads, mc.num_kv_heads, mc.head_dim, config.block_size, self.dtype,
            self.device, kv_quantized=int8_kv,
        )  # fmt: skip
        self.attention = select_backend(config.attention_backend, spec)
        self.graphs = self._make_graphs(mc)
        self._use_graphs = self.graphs is not None
        self._publish_placement()

    def _max_blocks_per_request(self, mc: ModelConfig) -> int:
        c = self.config
        context = min(c.max_model_len or mc.max_position_embeddings, mc.max_position_embeddings)
        return -(-min(context, c.num_blocks * c.block_size) // c.block_size)

    def _make_graphs(self, mc: ModelConfig) -> DecodeGraphs | None:
        if not self.config.cuda_graphs:
            log.info("CUDA graphs: off (cuda_graphs=false); decode steps run eagerly")
            return None
        if self.device.type != "cuda":
            log.info("CUDA graphs: no-op on device %s (they exist on CUDA only)", self.device)
            return None
        graphs = DecodeGraphs(
            self.model, self.attention, self._kv_storage, self.config.cuda_graph_batch_sizes,
            self._max_blocks_per_request(mc), self.config.block_size, self.scratch_block,
        )  # fmt: skip
        graphs.capture_all()
        return graphs

    def _publish_placement(self) -> None:
        devices = {str(t.device) for t in self.model.tensors()}
        assert len(devices) == 1, f"weights are spread over {sorted(devices)}"
        (weight_device,) = devices
        # Quantized weights come with scales in another dtype: the label names the scheme.
        quantized = self.config.quantization != "none"
        weight_dtype = self.config.quantization if quantized else _dtype_name(self.model.embed)
        kv_dtype = _dtype_name(self.kv_cache)
        ENGINE_TENSORS.labels(weight_device, weight_dtype, "weights").set(1)
        ENGINE_TENSORS.labels(str(self.kv_cache.device), kv_dtype, "kv_cache").set(1)
        graphs = "on" if self.graphs is not None else "off"
        ENGINE_ATTENTION.labels(self.attention.name, graphs).set(1)
        kv_gib = self._kv_storage.numel() * self._kv_storage.element_size() / 2**30
        log.info(
            "engine on %s: weights %s, KV cache %d blocks (%.2f GiB %s), attention %s, CUDA "
            "graphs %s", self.device, weight_dtype, self.config.num_blocks, kv_gib, kv_dtype,
            self.attention.name, graphs,
        )  # fmt: skip

    def host_tier(self, capacity_bytes: int, path: str | None) -> HostKVTier:
        """The host KV tier under this runner's pool (kv_offload_gb, kv_offload_path)."""
        return host_tier(self.kv_cache, capacity_bytes, path)

    def set_cuda_graphs(self, enabled: bool) -> None:
        """Benchmarks compare decode with and without the captured graphs."""
        self._use_graphs = enabled and self.graphs is not None

    def execute(self, batch: list[ScheduledRequest]) -> dict[str, int]:
        """Runs one forward pass over the batch; returns the next token of every request whose
        pass completed in this step."""
        sampled, logits = self.forward(batch)
        if not sampled:
            return {}
        token_ids = sample(logits, sampled)
        return {r.request_id: t for r, t in zip(sampled, token_ids, strict=True)}

    def _use_threads(self) -> None:
        """num_threads (None: every core this process may run on) for the OS thread that runs
        the model. torch's CPU thread count is OpenMP's, which is per OS thread: a worker builds
        its engine on one thread and steps it on the engine loop's. Set where the engine was
        built, it would leave the stepping thread at OpenMP's default and give the builder a
        team of its own; two teams are more threads than cores, and OpenMP then stops spinning
        at barriers: every parallel region of a step waits on a futex (a 2-thread decode step
        took 1.4x as long; docs/engine.md, Threads)."""
        if self._threads_set_on != threading.get_ident():
            torch.set_num_threads(self.config.num_threads or len(os.sched_getaffinity(0)))
            self._threads_set_on = threading.get_ident()

    def forward(self, batch: list[ScheduledRequest]) -> tuple[list[Request], torch.Tensor]:
        """Writes the batch's new KV into the cache; returns the requests that need a next token
        and their last-position logits [n, vocab] (float32)."""
        self._use_threads()
        step = self._prepare(batch)
        # A graph step samples every row, in batch order; a 1-token chunk of a prompt (the
        # budget's last token) also looks like a decode but needs no logits: run it eagerly.
        all_sample = len(step.sampled) == step.layout.num_requests
        if self._use_graphs and all_sample and self.graphs.can_run(step.layout):
            inputs = DecodeInputs(step.input_ids, step.positions, step.slot_block_ids, step.layout)
            return step.sampled, self.model.logits(self.graphs.run(inputs))
        return step.sampled, self._forward_eager(step)

    def _forward_eager(self, step: _Step) -> torch.Tensor:
        n = len(step.input_ids)
        # One host-to-device copy for all of the step's int inputs.
        ints = to_device(
            [*step.input_ids, *step.positions, *step.slot_block_ids, *step.logit_rows], self.device
        )
        input_ids, positions, slot_block_ids = ints[:n], ints[n : 2 * n], ints[2 * n : 3 * n]
        meta = AttentionMetadata(
            slot_block_ids=slot_block_ids,
            slot_offsets=positions % self.config.block_size,
            plan=self.attention.plan(step.layout),
        )
        hidden = self.model.forward_hidden(
            input_ids, positions, self._kv_storage, meta, self.attention
        )
        return self.model.logits(hidden[ints[3 * n :]])

    def _prepare(self, batch: list[ScheduledRequest]) -> _Step:
        bs = self.config.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slot_block_ids: list[int] = []
        logit_rows: list[int] = []
        sampled: list[Request] = []
        query_lens, context_lens, tables = [], [], []
        for item in batch:
            r, start = item.request, item.request.num_computed_tokens
            end = start + item.num_new_tokens
            input_ids.extend(r.token_ids[start:end])
            positions.extend(range(start, end))
            slot_block_ids.extend(r.block_ids[p // bs] for p in range(start, end))
            query_lens.append(item.num_new_tokens)
            context_lens.append(end)
            tables.append(r.block_ids[: -(-end // bs)])
            if item.completes_pass:
                logit_rows.append(len(input_ids) - 1)
                sampled.append(r)
        layout = StepLayout(query_lens, context_lens, tables)
        return _Step(input_ids, positions, slot_block_ids, logit_rows, sampled, layout)
