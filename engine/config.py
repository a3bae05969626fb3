"""Configuration: the model's architecture (read from config.json) and the engine's settings."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from engine.errors import InvalidRequestError

DType = Literal["float32", "bfloat16", "float16"]
MIN_CHUNK_SIZE, MAX_CHUNK_SIZE = 128, 2048


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
    dtype: DType = "float32"
    device: str = "cpu"
    block_size: int = 16
    num_blocks: int = 1024
    # Per-step token budget: a long prompt is prefilled in chunks of at most this many tokens,
    # and decode tokens of running requests ride along in the same step.
    chunk_size: int = 512
    max_num_seqs: int = 64
    # New requests are admitted only while at most this fraction of blocks is in use, which keeps
    # headroom for running requests to grow; cached free blocks are reclaimed (LRU) before any
    # request is preempted.
    watermark: float = 0.85
    enable_prefix_caching: bool = True
    num_threads: int | None = None
    max_model_len: int | None = None
    attention_backend: Literal["auto", "sdpa", "flash_attn"] = "auto"

    def __post_init__(self) -> None:
        if not MIN_CHUNK_SIZE <= self.chunk_size <= MAX_CHUNK_SIZE:
            raise InvalidRequestError(
                f"chunk_size must be in [{MIN_CHUNK_SIZE}, {MAX_CHUNK_SIZE}], got {self.chunk_size}"
            )
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise InvalidRequestError(f"dtype must be float32, bfloat16 or float16: {self.dtype}")
        if self.block_size <= 0 or self.num_blocks <= 0 or self.max_num_seqs <= 0:
            raise InvalidRequestError("block_size, num_blocks and max_num_seqs must be positive")
        if not 0.0 < self.watermark <= 1.0:
            raise InvalidRequestError(f"watermark must be in (0, 1], got {self.watermark}")
