"""The Llama-family decoder in plain PyTorch, reading and writing the paged KV cache."""

from __future__ import annotations

from types import ModuleType

import torch
import torch.nn.functional as F

from engine import cpu_kernels
from engine.attention import AttentionBackend, AttentionMetadata, write_kv
from engine.config import ModelConfig
from engine.quantization import (
    PreparedWeight,
    Quantization,
    linear,
    prepare,
    prepare_head,
    weight_tensors,
)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Hugging Face's LlamaRMSNorm (normalize in fp32, cast back, then scale) in one fused op
    # instead of five; bit-identical to HF's in fp32 (tests/engine/test_hf_parity.py).
    normed = F.rms_norm(x.float(), (x.shape[-1],), eps=eps)
    return weight * normed.to(x.dtype)


class RotaryEmbedding:
    """Precomputed cos/sin tables for every position (HF's rotate-half layout)."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device: torch.device) -> None:
        inv_freq = 1.0 / (
            cfg.rope_theta
            ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.int64).float() / cfg.head_dim)
        )
        positions = torch.arange(cfg.max_position_embeddings, dtype=torch.float32)
        freqs = torch.outer(positions, inv_freq)
        emb = torch.cat([freqs, freqs], dim=-1)  # [max_pos, head_dim]
        self.cos = emb.cos().to(dtype=dtype, device=device)
        self.sin = emb.sin().to(dtype=dtype, device=device)

    def at(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin for these positions: [T, 1, head_dim], looked up once per forward."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [T, heads, head_dim]
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


Rope = tuple[torch.Tensor, torch.Tensor]  # cos, sin of a step's positions: [T, 1, head_dim]


class TorchOps:
    """The decoder layer's element-wise steps as torch ops: any device, dtype and KV cache."""

    def __init__(self, cfg: ModelConfig) -> None:
        self.cfg = cfg

    def norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, weight, self.cfg.rms_norm_eps)

    def add_norm(
        self, x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual stream plus delta, and its norm."""
        x = x + delta
        return x, self.norm(x, weight)

    def rope_store(
        self, qkv: torch.Tensor, rope: Rope, layer_cache: torch.Tensor, meta: AttentionMetadata
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k rotated and k, v stored in the cache: q, k, v [T, heads, head_dim] as the
        cache holds them (write_kv)."""
        cfg = self.cfg
        q_size, kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        # q and k heads side by side: one RoPE over both (5 ops a layer instead of 10).
        qk = qkv[:, : q_size + kv_size].unflatten(-1, (-1, cfg.head_dim))
        q, k = apply_rope(qk, *rope).split([cfg.num_heads, cfg.num_kv_heads], dim=1)
        v = qkv[:, q_size + kv_size :].view(-1, cfg.num_kv_heads, cfg.head_dim)
        k, v = write_kv(layer_cache, meta, k, v)
        return q, k, v

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up


class FusedCPUOps(TorchOps):
    """The same steps as one C++ call each (engine/csrc/layer_ops.cpp), for a float32 model and
    KV cache on the CPU: a decode token's layer runs 4 element-wise calls instead of ~60 torch
    ops, whose dispatch cost more than the layer's int4 matmuls (docs/engine.md)."""

    def __init__(self, cfg: ModelConfig, kernels: ModuleType) -> None:
        super().__init__(cfg)
        self.kernels = kernels

    def norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return self.kernels.rms_norm(x, weight, self.cfg.rms_norm_eps)

    def add_norm(
        self, x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # x is the layer's own residual stream (a fresh tensor every layer): added in place.
        return x, self.kernels.add_rms_norm_(x, delta, weight, self.cfg.rms_norm_eps)

    def rope_store(
        self, qkv: torch.Tensor, rope: Rope, layer_cache: torch.Tensor, meta: AttentionMetadata
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        cfg = self.cfg
        qkv = qkv.contiguous()  # rotated in place (a one-row matmul may return it transposed)
        self.kernels.rope_store_kv_(
            qkv, *rope, layer_cache, meta.slot_block_ids, meta.slot_offsets, cfg.num_heads
        )
        heads = qkv.unflatten(-1, (-1, cfg.head_dim))
        return heads.split([cfg.num_heads, cfg.num_kv_heads, cfg.num_kv_heads], dim=1)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return self.kernels.silu_mul(gate_up)


class DecoderLayer:
    def __init__(self, cfg: ModelConfig, w: dict[str, torch.Tensor], prefix: str) -> None:
        """Takes (pops) this layer's tensors out of w: the unfused copies are freed layer by
        layer, so loading peaks near one model's size, not two (it matters on a GPU)."""
        self.cfg = cfg
        attn, mlp = f"{prefix}.self_attn", f"{prefix}.mlp"
        # q, k, v and gate, up are fused: fewer, larger matmuls.
        self.qkv_weight = torch.cat([w.pop(f"{attn}.{p}_proj.weight") for p in "qkv"])
        self.qkv_bias = (
            torch.cat([w.pop(f"{attn}.{p}_proj.bias") for p in "qkv"])
            if cfg.attention_bias
            else None
        )
        self.o_weight = w.pop(f"{attn}.o_proj.weight")
        gate_up = [w.pop(f"{mlp}.gate_proj.weight"), w.pop(f"{mlp}.up_proj.weight")]
        self.gate_up_weight = torch.cat(gate_up)
        self.down_weight = w.pop(f"{mlp}.down_proj.weight")
        self.input_norm = w.pop(f"{prefix}.input_layernorm.weight")
        self.post_attn_norm = w.pop(f"{prefix}.post_attention_layernorm.weight")

    def prepare(self, quantization: Quantization) -> None:
        """Every linear weight of the layer in its matmul's form (engine.quantization.prepare:
        int8 / int4 codes, or packed for oneDNN); norms stay."""
        self.qkv_weight = prepare(self.qkv_weight, quantization)
        self.o_weight = prepare(self.o_weight, quantization)
        self.gate_up_weight = prepare(self.gate_up_weight, quantization)
        self.down_weight = prepare(self.down_weight, quantization)

    def tensors(self) -> list[torch.Tensor]:
        linears = [self.qkv_weight, self.o_weight, self.gate_up_weight, self.down_weight]
        weights = [t for w in linears for t in weight_tensors(w)]
        bias = [] if self.qkv_bias is None else [self.qkv_bias]
        return [*weights, *bias, self.input_norm, self.post_attn_norm]

    def forward(
        self,
        x: torch.Tensor,  # [T, hidden]
        rope: Rope,
        layer_cache: torch.Tensor,
        meta: AttentionMetadata,
        attention: AttentionBackend,
        ops: TorchOps,
    ) -> torch.Tensor:
        h = ops.norm(x, self.input_norm)
        qkv = linear(h, self.qkv_weight, self.qkv_bias)
        q, k, v = ops.rope_store(qkv, rope, layer_cache, meta)
        o = attention.forward(q, layer_cache, meta.plan, k, v)
        x, h = ops.add_norm(x, linear(o.flatten(1), self.o_weight), self.post_attn_norm)
        return x + linear(ops.silu_mul(linear(h, self.gate_up_weight)), self.down_weight)


class LlamaModel:
    def __init__(
        self, cfg: ModelConfig, weights: dict[str, torch.Tensor], dtype: torch.dtype,
        device: torch.device, quantization: Quantization = "none",
    ) -> None:  # fmt: skip
        """weights: Hugging Face names -> tensors already in dtype on device (engine.loader);
        the dict is consumed. quantization int8 / int4: the layers' linear weights to that
        scheme, and a head that is exactly Q8_0 (the bundled GGUF's) read as its codes. Else the
        lm_head keeps the model's dtype; on the CPU in float32 it and the layers' float weights
        are packed for oneDNN (a tied head: a packed copy of the embedding table, which lookups
        keep reading)."""
        self.cfg = cfg
        w = weights
        self.embed = w.pop("model.embed_tokens.weight")
        self.lm_head: torch.Tensor | PreparedWeight = prepare_head(
            self.embed if cfg.tie_word_embeddings else w.pop("lm_head.weight"), quantization
        )
        w.pop("lm_head.weight", None)  # a tied checkpoint may still carry its copy
        self.final_norm = w.pop("model.norm.weight")
        self.layers = [DecoderLayer(cfg, w, f"model.layers.{i}") for i in range(cfg.num_layers)]
        self.rope = RotaryEmbedding(cfg, dtype, device)
        for layer in self.layers:
            layer.prepare(quantization)
        self.torch_ops = TorchOps(cfg)
        self.fused_ops = self.torch_ops
        if device.type == "cpu" and dtype == torch.float32:
            kernels = cpu_kernels.load_or_none("the decoder layers' element-wise steps: torch ops")
            if kernels is not None:
                self.fused_ops = FusedCPUOps(cfg, kernels)

    def tensors(self) -> list[torch.Tensor]:
        """Every weight and table the forward pass reads (to check where they live)."""
        layers = [t for layer in self.layers for t in layer.tensors()]
        rope = [self.rope.cos, self.rope.sin]
        head = weight_tensors(self.lm_head)
        return [self.embed, *head, self.final_norm, *layers, *rope]

    @torch.inference_mode()
    def forward_hidden(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        kv_cache: torch.Tensor,  # [num_blocks, num_layers, 2, block_size, Hkv, D]
        meta: AttentionMetadata,
        attention: AttentionBackend,
    ) -> torch.Tensor:  # [T, hidden], before the final norm
        x = self.embed[input_ids]
        rope = self.rope.at(positions)
        # An int8 KV cache is quantized on store, which only the torch ops do.
        ops = self.fused_ops if kv_cache.dtype == x.dtype else self.torch_ops
        for i, layer in enumerate(self.layers):
            x = layer.forward(x, rope, kv_cache[:, i], meta, attention, ops)
        return x

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [n, hidden] -> [n, vocab] fp32
        h = rms_norm(hidden, self.final_norm, self.cfg.rms_norm_eps)
        return linear(h, self.lm_head).float()
