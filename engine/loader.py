"""Model weights: loads a Hugging Face-format directory onto the device; converts a GGUF into
one."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file
from tqdm import tqdm

# llama.cpp tensor names -> Hugging Face Llama names ("{i}" is the layer index).
_GGUF_TO_HF = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "blk.{i}.attn_norm.weight": "model.layers.{i}.input_layernorm.weight",
    "blk.{i}.ffn_norm.weight": "model.layers.{i}.post_attention_layernorm.weight",
    "blk.{i}.attn_q.weight": "model.layers.{i}.self_attn.q_proj.weight",
    "blk.{i}.attn_k.weight": "model.layers.{i}.self_attn.k_proj.weight",
    "blk.{i}.attn_v.weight": "model.layers.{i}.self_attn.v_proj.weight",
    "blk.{i}.attn_q.bias": "model.layers.{i}.self_attn.q_proj.bias",
    "blk.{i}.attn_k.bias": "model.layers.{i}.self_attn.k_proj.bias",
    "blk.{i}.attn_v.bias": "model.layers.{i}.self_attn.v_proj.bias",
    "blk.{i}.attn_output.weight": "model.layers.{i}.self_attn.o_proj.weight",
    "blk.{i}.ffn_gate.weight": "model.layers.{i}.mlp.gate_proj.weight",
    "blk.{i}.ffn_up.weight": "model.layers.{i}.mlp.up_proj.weight",
    "blk.{i}.ffn_down.weight": "model.layers.{i}.mlp.down_proj.weight",
}


def load_weights(
    model_dir: Path, dtype: torch.dtype, device: torch.device
) -> dict[str, torch.Tensor]:
    """Every tensor of the directory's *.safetensors, in dtype, on device. One tensor at a time
    (read from the memory-mapped file, moved, then cast), so the device never holds a second,
    full-precision copy of the model."""
    from safetensors import safe_open

    weights: dict[str, torch.Tensor] = {}
    for path in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                weights[name] = f.get_tensor(name).to(device).to(dtype)
    if not weights:
        raise FileNotFoundError(f"{model_dir}: no *.safetensors files")
    return weights


def convert_gguf(gguf_path: Path, out_dir: Path) -> None:
    """Dequantizes a llama-architecture GGUF into fp32 safetensors + HF config and tokenizer."""
    import gguf

    reader = gguf.GGUFReader(str(gguf_path))
    meta = {name: field for name, field in reader.fields.items()}
    arch = _field(meta, "general.architecture")
    if arch not in ("llama", "qwen2"):
        raise ValueError(f"{gguf_path}: architecture {arch!r} is not supported (llama, qwen2)")
    config = _hf_config(meta, arch)
    num_heads, num_kv_heads = config["num_attention_heads"], config["num_key_value_heads"]

    tensors: dict[str, torch.Tensor] = {}
    for t in tqdm(reader.tensors, desc=f"dequantizing {gguf_path.name}", unit="tensor"):
        weights = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        # llama.cpp stores llama q/k rows in its own RoPE order; qwen2 GGUFs are not permuted.
        if arch == "llama" and t.name.endswith("attn_q.weight"):
            weights = _unpermute(weights, num_heads)
        elif arch == "llama" and t.name.endswith("attn_k.weight"):
            weights = _unpermute(weights, num_kv_heads)
        tensors[_hf_name(t.name)] = torch.from_numpy(np.ascontiguousarray(weights))
    config["tie_word_embeddings"] = "lm_head.weight" not in tensors

    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    from engine.tokenizer import write_tokenizer_files

    write_tokenizer_files(meta, out_dir)


def _unpermute(weights: np.ndarray, num_heads: int) -> np.ndarray:
    # llama.cpp interleaves each head's two rotary halves: rows (h, d/2, 2) -> HF's (h, 2, d/2).
    rows, cols = weights.shape
    return (
        weights.reshape(num_heads, rows // num_heads // 2, 2, cols)
        .swapaxes(1, 2)
        .reshape(rows, cols)
    )


def _hf_name(gguf_name: str) -> str:
    parts = gguf_name.split(".")
    if parts[0] == "blk":
        template = _GGUF_TO_HF.get(".".join(["blk", "{i}", *parts[2:]]))
        if template:
            return template.format(i=parts[1])
    elif gguf_name in _GGUF_TO_HF:
        return _GGUF_TO_HF[gguf_name]
    raise ValueError(f"unexpected GGUF tensor {gguf_name!r}")


def _field(meta: dict, key: str, default: object = None) -> object:
    if key not in meta:
        return default
    return meta[key].contents()


def _hf_config(meta: dict, arch: str) -> dict:
    def get(key: str, default: object = None) -> object:
        return _field(meta, f"{arch}.{key}", default)

    hidden = int(get("embedding_length"))
    num_heads = int(get("attention.head_count"))
    vocab_size = get("vocab_size") or len(meta["tokenizer.ggml.tokens"].data)
    return {
        "architectures": ["Qwen2ForCausalLM" if arch == "qwen2" else "LlamaForCausalLM"],
        "model_type": arch,
        "hidden_size": hidden,
        "intermediate_size": int(get("feed_forward_length")),
        "num_hidden_layers": int(get("block_count")),
        "num_attention_heads": num_heads,
        "num_key_value_heads": int(get("attention.head_count_kv", num_heads)),
        "head_dim": int(get("rope.dimension_count", hidden // num_heads)),
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon")),
        "rope_theta": float(get("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(get("context_length")),
        "vocab_size": int(vocab_size),
        "bos_token_id": int(_field(meta, "tokenizer.ggml.bos_token_id", 1)),
        "eos_token_id": int(_field(meta, "tokenizer.ggml.eos_token_id", 2)),
        "hidden_act": "silu",
        "attention_bias": arch == "qwen2",
        "torch_dtype": "float32",
    }
