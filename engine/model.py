"""The Llama-family decoder in plain PyTorch, reading and writing the paged KV cache."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from engine.attention import AttentionBackend, AttentionMetadata, write_kv
from engine.config import ModelConfig


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Same arithmetic as Hugging Face's LlamaRMSNorm (in fp32, cast back), for token-exact output.
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


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


class DecoderLayer:
    def __init__(self, cfg: ModelConfig, w: dict[str, torch.Tensor], prefix: str) -> None:
        self.cfg = cfg
        attn, mlp = f"{prefix}.self_attn", f"{prefix}.mlp"
        # q, k, v and gate, up are fused: fewer, larger matmuls.
        self.qkv_weight = torch.cat([w[f"{attn}.{p}_proj.weight"] for p in "qkv"])
        self.qkv_bias = (
            torch.cat([w[f"{attn}.{p}_proj.bias"] for p in "qkv"]) if cfg.attention_bias else None
        )
        self.o_weight = w[f"{attn}.o_proj.weight"]
        self.gate_up_weight = torch.cat([w[f"{mlp}.gate_proj.weight"], w[f"{mlp}.up_proj.weight"]])
        self.down_weight = w[f"{mlp}.down_proj.weight"]
        self.input_norm = w[f"{prefix}.input_layernorm.weight"]
        self.post_attn_norm = w[f"{prefix}.post_attention_layernorm.weight"]

    def forward(
        self,
        x: torch.Tensor,  # [T, hidden]
        rope: tuple[torch.Tensor, torch.Tensor],  # cos, sin of this step's positions
        layer_cache: torch.Tensor,
        meta: AttentionMetadata,
        attention: AttentionBackend,
    ) -> torch.Tensor:
        cfg = self.cfg
        h = rms_norm(x, self.input_norm, cfg.rms_norm_eps)
        qkv = F.linear(h, self.qkv_weight, self.qkv_bias)
        q_size, kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        q = apply_rope(q.view(-1, cfg.num_heads, cfg.head_dim), *rope)
        k = apply_rope(k.view(-1, cfg.num_kv_heads, cfg.head_dim), *rope)
        v = v.view(-1, cfg.num_kv_heads, cfg.head_dim)
        write_kv(layer_cache, meta, k, v)
        o = attention.forward(q, layer_cache, meta, k, v)
        x = x + F.linear(o.flatten(1), self.o_weight)
        h = rms_norm(x, self.post_attn_norm, cfg.rms_norm_eps)
        gate, up = F.linear(h, self.gate_up_weight).chunk(2, dim=-1)
        return x + F.linear(F.silu(gate) * up, self.down_weight)


class LlamaModel:
    def __init__(self, cfg: ModelConfig, model_dir: Path, dtype: torch.dtype, device: torch.device):
        self.cfg = cfg
        weights = {}
        for path in sorted(model_dir.glob("*.safetensors")):
            weights.update(load_file(str(path), device=str(device)))
        if not weights:
            raise FileNotFoundError(f"{model_dir}: no *.safetensors files")
        w = {name: t.to(dtype) for name, t in weights.items()}
        self.embed = w["model.embed_tokens.weight"]
        self.lm_head = self.embed if cfg.tie_word_embeddings else w["lm_head.weight"]
        self.final_norm = w["model.norm.weight"]
        self.layers = [DecoderLayer(cfg, w, f"model.layers.{i}") for i in range(cfg.num_layers)]
        self.rope = RotaryEmbedding(cfg, dtype, device)

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        kv_cache: torch.Tensor,  # [num_blocks, num_layers, 2, block_size, Hkv, D]
        meta: AttentionMetadata,
        attention: AttentionBackend,
        logit_rows: torch.Tensor,  # which of the T positions need logits
    ) -> torch.Tensor:  # [len(logit_rows), vocab] float32
        x = self.embed[input_ids]
        rope = self.rope.at(positions)
        for i, layer in enumerate(self.layers):
            x = layer.forward(x, rope, kv_cache[:, i], meta, attention)
        h = rms_norm(x[logit_rows], self.final_norm, self.cfg.rms_norm_eps)
        return F.linear(h, self.lm_head).float()
