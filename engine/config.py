"""Configuration: the model's architecture (read from config.json) and the engine's settings."""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, get_args

from engine.errors import InvalidRequestError
from engine.model_files import linear_weight_format

DType = Literal["float32", "bfloat16", "float16"]
AttentionBackendName = Literal["auto", "sdpa", "cpu_paged", "flashinfer", "flash_attn"]
# auto: the model's dtype; int8: engine/kv_quant.py (declared here: this module stays torch-free).
KVCacheDtype = Literal["auto", "int8"]
KV_CACHE_DTYPES: tuple[KVCacheDtype, ...] = ("auto", "int8")
MIN_CHUNK_SIZE, MAX_CHUNK_SIZE = 128, 2048
# A CPU step's fixed cost in prompt tokens' compute (EngineConfig.step_overhead_tokens): the
# bundled model's, 17.5 ms + 1.08 ms a token at two threads (int4), 35 ms + 2.1 ms at one
# (fp32), on the Zen 4 host (docs/engine.md).
CPU_STEP_OVERHEAD_TOKENS = 16
# Decode steps are captured as CUDA graphs at these batch sizes (up to max_num_seqs); a step of n
# decodes replays the smallest one >= n, the padding rows writing to a scratch block.
CUDA_GRAPH_BATCH_SIZES = (1, 2, 4, 8, *range(16, 257, 8), *range(272, 1025, 16))
_DEVICE_PATTERN = re.compile(r"auto|cpu|cuda(:(0|[1-9][0-9]*))?")


def step_overhead_tokens_for(device: str) -> int:
    """EngineConfig.step_overhead_tokens' default: CPU_STEP_OVERHEAD_TOKENS on a CPU; 0 on a
    GPU, whose step's fixed cost is worth thousands of prompt tokens (splitting would only
    delay)."""
    return CPU_STEP_OVERHEAD_TOKENS if device == "cpu" else 0


def resolve_device(spec: str) -> str:
    """'auto' | 'cpu' | 'cuda' | 'cuda:N' -> the device the engine runs on ('cpu' or 'cuda:N').

    auto takes CUDA when torch sees a GPU. A CUDA device that is not there is an error, never a
    silent fall back to the CPU: a GPU pod running on its CPU is the failure this setting exists
    to prevent."""
    if not isinstance(spec, str) or not _DEVICE_PATTERN.fullmatch(spec):
        raise InvalidRequestError(f"device must be auto, cpu, cuda or cuda:N, got {spec!r}")
    import torch

    if spec == "cpu" or (spec == "auto" and not torch.cuda.is_available()):
        return "cpu"
    if not torch.cuda.is_available():
        raise InvalidRequestError(
            f"device {spec} asked for, but torch {torch.__version__} sees no CUDA device "
            f"(built with CUDA {torch.version.cuda}); use --device cpu or auto"
        )
    index = 0 if spec in ("auto", "cuda") else int(spec.split(":")[1])
    count = torch.cuda.device_count()
    if index >= count:
        raise InvalidRequestError(
            f"device {spec} asked for, but torch sees {count} CUDA device(s): "
            f"cuda:0..cuda:{count - 1}"
        )
    return f"cuda:{index}"


def default_dtype(device: str) -> DType:
    """bfloat16 on CUDA (tensor cores, half the KV bytes); float32 on CPUs, many of which lack
    native bf16 (docs/engine.md)."""
    return "bfloat16" if device.startswith("cuda") else "float32"


@dataclass(frozen=True, slots=True)
class ModelConfig:
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool

    @classmethod
    def from_dir(cls, model_dir: Path) -> ModelConfig:
        raw = json.loads((model_dir / "config.json").read_text())
        arch = (raw.get("architectures") or ["?"])[0]
        if arch not in ("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM"):
            raise ValueError(f"{model_dir}: architecture {arch} is not supported (Llama family)")
        # transformers 5 moves rope_theta into rope_parameters; accept both spellings.
        rope_theta = raw.get("rope_theta") or (raw.get("rope_parameters") or {}).get("rope_theta")
        num_heads = raw["num_attention_heads"]
        return cls(
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_layers=raw["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=raw.get("num_key_value_heads", num_heads),
            head_dim=raw.get("head_dim") or raw["hidden_size"] // num_heads,
            vocab_size=raw["vocab_size"],
            rms_norm_eps=raw["rms_norm_eps"],
            rope_theta=float(rope_theta or 10000.0),
            max_position_embeddings=raw["max_position_embeddings"],
            tie_word_embeddings=raw.get("tie_word_embeddings", False),
            attention_bias=raw.get("attention_bias", arch == "Qwen2ForCausalLM"),
        )


@dataclass(frozen=True, slots=True)
class EngineConfig:
    model: str = "smollm2-135m"
    # "auto" (the default) becomes default_dtype(device), and device "auto" becomes "cpu" or
    # "cuda:N" in __post_init__: every reader of a config sees the resolved values.
    dtype: DType | Literal["auto"] = "auto"
    device: str = "auto"
    block_size: int = 16
    num_blocks: int = 1024
    # Per-step token budget: a long prompt is prefilled in chunks of at most this many tokens,
    # and decode tokens of running requests ride along in the same step.
    chunk_size: int = 512
    # What one step's fixed cost (reading the weights, launches, Python) is worth in prompt
    # tokens' compute. Above 0, a burst of prompts one step could take is split over a few steps
    # where that gives the smaller sum of first-token waits (engine/scheduler.py); 0 does not
    # weigh it: every prompt that fits joins its step. None (the default): the device's
    # (step_overhead_tokens_for), which the scheduler reads; the simulator's engines take the
    # modelled device's instead of the host's.
    step_overhead_tokens: int | None = None
    max_num_seqs: int = 64
    # New requests are admitted only while at most this fraction of blocks is in use, which keeps
    # headroom for running requests to grow; cached free blocks are reclaimed (LRU) before any
    # request is preempted.
    watermark: float = 0.85
    enable_prefix_caching: bool = True
    # torch's CPU threads on the thread that steps the engine; None: every core it may run on.
    num_threads: int | None = None
    max_model_len: int | None = None
    # auto: FlashInfer, then flash-attn, then torch SDPA, the first that loads and passes its
    # start-up self-check on this device and dtype (the runner logs what it picked and why).
    attention_backend: AttentionBackendName = "auto"
    # Decode steps replay CUDA graphs (CUDA only; on the CPU this setting does nothing).
    cuda_graphs: bool = True
    # "auto" (the default): the model file's own 4-bit codes where they can be kept exactly (a
    # Q4_1 GGUF on the CPU, the bundled model's case: int4), else "none"; resolved below, so a
    # config's readers see the scheme that runs. "none" keeps the weights in dtype (the fp32
    # path the exactness tests name); "int8" / "int4": weight-only int8 / group-wise int4
    # linear layers (engine.quantization; docs/engine.md has what each costs in quality and
    # buys in speed; int4 is CPU-only).
    quantization: str = "auto"
    # "int8": the KV cache holds int8 values with one scale per token and head (engine/kv_quant.py,
    # a quarter of fp32's bytes); "auto" keeps it in dtype. Prefill and decode workers must agree.
    kv_cache_dtype: KVCacheDtype = "auto"
    # The host KV tier under the pool (engine/kv_tier.py), in GiB; 0 (the default) turns it off:
    # host memory is shared by everything on the host, and a default share could push a pod
    # past its memory limit unseen. Full prefix blocks the pool evicts are kept there and
    # loaded back on a prefix hit.
    kv_offload_gb: float = 0.0
    # A directory on local disk for the tier's file; None keeps the tier in host memory.
    kv_offload_path: str | None = None

    def __post_init__(self) -> None:
        device = resolve_device(self.device)
        object.__setattr__(self, "device", device)
        if self.dtype == "auto":
            object.__setattr__(self, "dtype", default_dtype(device))
        overhead = self.step_overhead_tokens
        if overhead is not None and (not isinstance(overhead, int) or overhead < 0):
            raise InvalidRequestError(
                f"step_overhead_tokens must be an integer >= 0, got {self.step_overhead_tokens!r}"
            )
        if self.attention_backend not in get_args(AttentionBackendName):
            raise InvalidRequestError(
                "attention_backend must be auto, sdpa, cpu_paged, flashinfer or flash_attn, got "
                f"{self.attention_backend!r}"
            )
        if self.quantization == "auto":
            resolved = auto_quantization(self.model, device, self.dtype)
            object.__setattr__(self, "quantization", resolved)
        if self.quantization not in ("none", "int8", "int4"):
            raise InvalidRequestError(
                f"quantization must be auto, none, int8 or int4, got {self.quantization!r}"
            )
        if self.quantization == "int4" and device != "cpu":
            # torch's CUDA int4 kernel (_weight_int4pack_mm) packs differently and has not been
            # run here (no GPU on the machines this was built on): refused, not guessed.
            raise InvalidRequestError(f"quantization int4 runs on the CPU only, not {device}")
        if self.quantization == "int4" and self.dtype != "float32":
            raise InvalidRequestError(
                f"quantization int4 runs in float32 (its kernel's activations), not {self.dtype}"
            )
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise InvalidRequestError(
                f"kv_cache_dtype must be auto or int8, got {self.kv_cache_dtype!r}"
            )
        if not MIN_CHUNK_SIZE <= self.chunk_size <= MAX_CHUNK_SIZE:
            raise InvalidRequestError(
                f"chunk_size must be in [{MIN_CHUNK_SIZE}, {MAX_CHUNK_SIZE}], got {self.chunk_size}"
            )
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise InvalidRequestError(
                f"dtype must be auto, float32, bfloat16 or float16: {self.dtype}"
            )
        if self.block_size <= 0 or self.num_blocks <= 0 or self.max_num_seqs <= 0:
            raise InvalidRequestError("block_size, num_blocks and max_num_seqs must be positive")
        if not 0.0 < self.watermark <= 1.0:
            raise InvalidRequestError(f"watermark must be in (0, 1], got {self.watermark}")
        self._check_offload()

    def _check_offload(self) -> None:
        gb, path = self.kv_offload_gb, self.kv_offload_path
        if not (isinstance(gb, int | float) and math.isfinite(gb) and gb >= 0):
            raise InvalidRequestError(f"kv_offload_gb must be a number >= 0, got {gb!r}")
        if gb > 0 and not self.enable_prefix_caching:
            raise InvalidRequestError(
                "kv_offload_gb needs prefix caching: the host tier keeps cached prefix blocks"
            )
        if path is not None and gb == 0:
            raise InvalidRequestError(
                f"kv_offload_path {path!r} is set but kv_offload_gb is 0: give the tier a size"
            )
        if path is not None and not os.path.isdir(path):
            raise InvalidRequestError(f"kv_offload_path {path!r} is not an existing directory")

    @property
    def kv_offload_bytes(self) -> int:
        return int(self.kv_offload_gb * 2**30)

    @property
    def is_cuda(self) -> bool:
        return self.device.startswith("cuda")

    @property
    def cuda_graph_batch_sizes(self) -> tuple[int, ...]:
        """Captured sizes: the standard ones below max_num_seqs, and max_num_seqs itself."""
        sizes = [n for n in CUDA_GRAPH_BATCH_SIZES if n < self.max_num_seqs]
        return (*sizes, self.max_num_seqs)


def auto_quantization(model: str, device: str, dtype: str) -> str:
    """int4 for a model whose GGUF stores its layers' linears as Q4_1, on the CPU in float32:
    the int4 path keeps exactly those codes (each group's min/max recovers them), so the engine
    reads the file's own 4 bits a weight instead of its dequantized 32. Anything else: none
    (other GGUF formats would be rounded again; int4 runs neither on CUDA nor in bfloat16)."""
    if device != "cpu" or dtype != "float32":
        return "none"
    return "int4" if linear_weight_format(model) == "Q4_1" else "none"
