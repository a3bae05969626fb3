"""Cost models: the seconds one engine step takes (the model forward is the only part of a worker
the simulator does not run), and what moving KV and a message between processes costs.

Two models: LocalCost, fitted on this machine's real engine by sim/calibrate.py, and
RooflineCost, an analytical model of H100/H200-class GPUs (compute for prefill, HBM bandwidth
for decode, tensor parallelism over NVLink).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Protocol

from engine.config import CPU_STEP_OVERHEAD_TOKENS, ModelConfig
from engine.quantization import PLAIN_MAX_ROWS
from engine.scheduler import ScheduledRequest

LOCAL_COEFFICIENTS = Path(__file__).with_name("local_cpu.json")
# The weights the real engine ran when local_cpu.json was fitted: the fp32 path, not the CPU
# default (int4). Calibration and validation run the same, so a fit is compared with its engine.
FITTED_QUANTIZATION = "none"


@dataclass(frozen=True, slots=True)
class StepShape:
    """What a step's cost depends on, read off the scheduled batch the way the model runner
    splits it: a request with one new token after cached context is a decode, the rest are
    prefill segments."""

    num_prefill_tokens: int = 0
    num_attention_pairs: int = 0  # prefill: query-key pairs, n * (context + (n + 1) / 2)
    prefill_context: int = 0  # prefill: cached tokens its segments attend to (KV read)
    num_prefill_segments: int = 0
    num_decode: int = 0
    decode_context: int = 0  # decode: tokens of KV the batch reads
    num_sampled: int = 0  # rows that need logits

    @property
    def is_small(self) -> bool:
        """Few enough rows for the fp32 path's small-row matmul (engine/quantization.py)."""
        return self.num_prefill_tokens + self.num_decode <= PLAIN_MAX_ROWS

    @classmethod
    def of(cls, batch: Sequence[ScheduledRequest]) -> StepShape:
        tokens = pairs = context = segments = decodes = decode_ctx = sampled = 0
        for item in batch:
            start, n = item.request.num_computed_tokens, item.num_new_tokens
            sampled += start + n == item.request.num_tokens
            if n == 1 and start > 0:
                decodes += 1
                decode_ctx += start + 1
            else:
                tokens += n
                pairs += n * start + n * (n + 1) // 2
                context += start
                segments += 1
        return cls(tokens, pairs, context, segments, decodes, decode_ctx, sampled)


class CostModel(Protocol):
    model: ModelConfig
    hop_s: float  # one message between two processes (client, router, workers)
    host_copy_bytes_per_s: float  # the host KV tier's copies, either way (engine/kv_tier.py)
    # The modelled device's default EngineConfig.step_overhead_tokens (step_overhead_tokens_for)
    step_overhead_tokens: int

    @property
    def kv_bytes_per_token(self) -> int: ...

    def step_s(self, shape: StepShape) -> float: ...

    def kv_transfer_s(self, num_tokens: int) -> float: ...


def kv_bytes_per_token(model: ModelConfig, bytes_per_element: float) -> int:
    return int(2 * model.num_layers * model.num_kv_heads * model.head_dim * bytes_per_element)


# ---- this machine -----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class LocalCoefficients:
    """step_s = overhead + a * prefill tokens + b * attention pairs + c * decodes + d * decode
    context (+ e for a step of at most PLAIN_MAX_ROWS rows, which the fitted fp32 path computes
    with a matmul of its own: engine/quantization.py), least squares over timed real steps
    (sim/calibrate.py writes local_cpu.json)."""

    overhead_s: float
    per_prefill_token_s: float
    per_attention_pair_s: float
    per_decode_s: float
    per_decode_context_s: float
    threads: int
    model: dict  # ModelConfig fields of the model timed
    kv_bytes_per_token: int
    per_small_step_s: float = 0.0  # 0 in coefficient files fitted before the term
    fit: dict = field(default_factory=dict)  # the points and residuals, for the record

    @classmethod
    def load(cls, path: Path = LOCAL_COEFFICIENTS) -> LocalCoefficients:
        return cls(**json.loads(path.read_text()))

    def save(self, path: Path = LOCAL_COEFFICIENTS) -> None:
        path.write_text(json.dumps(asdict(self), indent=1) + "\n")


@dataclass(frozen=True, slots=True)
class LocalCost:
    """Single-thread workers on this machine's cores. Workers busy at once beyond the cores
    share them, so a step slows by busy_threads / num_cores (set by the runner)."""

    coefficients: LocalCoefficients
    # Loopback: a gRPC/HTTP message between two Python processes on 2 cores (not fitted).
    hop_s: float = 0.002
    # The TCP KV backend: a plain TCP socket measured ~2.1 GB/s on these machines; one
    # connection per send.
    kv_bytes_per_s: float = 2.1e9
    kv_latency_s: float = 0.001
    # The host KV tier in host memory: bench/kv_tier.py's loads ran at 10.8-11.5 GB/s on the
    # AVX-512 host (2.8 GB/s on the AMD one); one memory-to-memory copy per block.
    host_copy_bytes_per_s: float = 10e9
    num_cores: int = 2
    step_overhead_tokens: int = CPU_STEP_OVERHEAD_TOKENS
    model: ModelConfig = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "model", ModelConfig(**self.coefficients.model))

    def step_s(self, shape: StepShape) -> float:
        c = self.coefficients
        return (
            c.overhead_s
            + c.per_prefill_token_s * shape.num_prefill_tokens
            + c.per_attention_pair_s * shape.num_attention_pairs
            + c.per_decode_s * shape.num_decode
            + c.per_decode_context_s * shape.decode_context
            + c.per_small_step_s * shape.is_small
        )

    @property
    def kv_bytes_per_token(self) -> int:
        return self.coefficients.kv_bytes_per_token

    def kv_transfer_s(self, num_tokens: int) -> float:
        num_bytes = num_tokens * self.kv_bytes_per_token
        return self.kv_latency_s + num_bytes / self.kv_bytes_per_s


# ---- GPUs -------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class GPU:
    name: str
    dense_flops: float  # bf16 tensor-core peak, FLOP/s
    hbm_bytes_per_s: float
    memory_bytes: float
    nvlink_bytes_per_s: float  # per direction


H100 = GPU("H100-SXM-80GB", 989e12, 3.35e12, 80e9, 450e9)
H200 = GPU("H200-SXM-141GB", 989e12, 4.8e12, 141e9, 450e9)
GPUS = {"h100": H100, "h200": H200}


def _llama(layers: int, hidden: int, inter: int, heads: int) -> ModelConfig:
    return ModelConfig(
        hidden_size=hidden, intermediate_size=inter, num_layers=layers, num_heads=heads,
        num_kv_heads=8, head_dim=128, vocab_size=128256, rms_norm_eps=1e-5,
        rope_theta=500000.0, max_position_embeddings=8192, tie_word_embeddings=False,
        attention_bias=False,
    )  # fmt: skip


LLAMA3_8B = _llama(32, 4096, 14336, 32)
LLAMA3_70B = _llama(80, 8192, 28672, 64)
MODELS = {"llama3-8b": LLAMA3_8B, "llama3-70b": LLAMA3_70B}


@dataclass(frozen=True, slots=True)
class RooflineCost:
    """step_s = max(compute, memory) + TP all-reduces + a fixed per-step overhead.

    compute: matmul FLOPs (2 * weights per token, lm_head per sampled row) plus attention
    (4 * layers * heads * head_dim per query-key pair) at peak * mfu over tp GPUs.
    memory: every weight once per step plus the KV read and written, at HBM * mbu.
    """

    model: ModelConfig
    gpu: GPU = H100
    tp: int = 1
    weight_bytes_per_param: float = 2.0  # bf16; 0.5625 for 4-bit weights with group scales
    kv_bytes_per_element: float = 2.0
    mfu: float = 0.5
    mbu: float = 0.8
    step_overhead_s: float = 0.002  # scheduler + launch per step (CPU side)
    step_overhead_tokens: int = 0  # a GPU's: bursts are not split
    allreduce_latency_s: float = 10e-6
    kv_link_bytes_per_s: float = 50e9  # 400 Gb/s RDMA between nodes; NVLink within one
    kv_latency_s: float = 20e-6
    hop_s: float = 100e-6  # one RPC inside a data centre
    # The host KV tier in page-locked host memory: DMA over the GPU's PCIe Gen5 x16 link.
    host_copy_bytes_per_s: float = 50e9

    @property
    def layer_params(self) -> int:
        m = self.model
        q, kv = m.num_heads * m.head_dim, m.num_kv_heads * m.head_dim
        return (
            m.hidden_size * (q + 2 * kv)
            + q * m.hidden_size
            + 3 * m.hidden_size * (m.intermediate_size)
        )

    @property
    def weight_bytes(self) -> float:
        embeddings = self.model.vocab_size * self.model.hidden_size
        num_params = self.model.num_layers * self.layer_params + 2 * embeddings
        return num_params * self.weight_bytes_per_param

    @property
    def kv_bytes_per_token(self) -> int:
        return kv_bytes_per_token(self.model, self.kv_bytes_per_element)

    def num_kv_blocks(self, block_size: int, memory_fraction: float = 0.9) -> int:
        """KV blocks that fit beside the weights (and ~2 GB of activations per GPU)."""
        free = self.tp * (self.gpu.memory_bytes * memory_fraction - 2e9) - self.weight_bytes
        if free <= 0:
            raise ValueError(f"{self.weight_bytes / 1e9:.0f} GB of weights leave no KV room")
        return int(free // (self.kv_bytes_per_token * block_size))

    def step_s(self, shape: StepShape) -> float:
        m = self.model
        num_tokens = shape.num_prefill_tokens + shape.num_decode
        attention_pairs = shape.num_attention_pairs + shape.decode_context
        flops = (
            2 * m.num_layers * self.layer_params * num_tokens
            + 2 * m.vocab_size * m.hidden_size * shape.num_sampled
            + 4 * m.num_layers * m.num_heads * m.head_dim * attention_pairs
        )
        compute_s = flops / (self.tp * self.gpu.dense_flops * self.mfu)
        kv_tokens = shape.prefill_context + shape.decode_context + num_tokens
        memory_bytes = self.weight_bytes + kv_tokens * self.kv_bytes_per_token
        memory_s = memory_bytes / (self.tp * self.gpu.hbm_bytes_per_s * self.mbu)
        return max(compute_s, memory_s) + self._allreduce_s(num_tokens) + self.step_overhead_s

    def _allreduce_s(self, num_tokens: int) -> float:
        if self.tp == 1:
            return 0.0
        # Two per layer (after attention and after the MLP); ring all-reduce of bf16 activations.
        num_bytes = num_tokens * self.model.hidden_size * 2
        one = 2 * (self.tp - 1) / self.tp * num_bytes / self.gpu.nvlink_bytes_per_s
        return 2 * self.model.num_layers * (one + self.allreduce_latency_s)

    def kv_transfer_s(self, num_tokens: int) -> float:
        return self.kv_latency_s + num_tokens * self.kv_bytes_per_token / self.kv_link_bytes_per_s
