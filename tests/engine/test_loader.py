"""Model sources: a GGUF path converts to the same weights and tokenizer as transformers reads."""

from __future__ import annotations

import torch
from safetensors.torch import load_file

from engine import LLM, SamplingParams
from engine.model_files import BUNDLED_GGUF, resolve_model
from engine.tokenizer import TextTokenizer

TEXTS = [
    "Hello world 12345, 你好!",
    "def f(x):\n    return x**2  # 3.14",
    "  spaces   and\ttabs<|im_end|>\n\n",
]


def bundled_gguf_path():
    import importlib.util
    from pathlib import Path

    package, filename = BUNDLED_GGUF["smollm2-135m"]
    return Path(importlib.util.find_spec(package).submodule_search_locations[0]) / filename


def test_a_gguf_path_converts_like_the_bundled_name(tmp_path, monkeypatch, model_dir):
    monkeypatch.setenv("PDSERVE_CACHE", str(tmp_path))
    converted = resolve_model(str(bundled_gguf_path()))
    assert converted.parent == tmp_path / "models"
    ours = load_file(str(converted / "model.safetensors"))
    cached = load_file(str(model_dir / "model.safetensors"))
    assert ours.keys() == cached.keys()
    assert all(torch.equal(ours[k], cached[k]) for k in ours)
    assert resolve_model(str(bundled_gguf_path())) == converted  # second time: the cache


def test_tokenizer_matches_transformers_gguf_tokenizer(model_dir):
    from transformers import AutoTokenizer

    path = bundled_gguf_path()
    reference = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    ours = TextTokenizer.load(model_dir)
    for text in TEXTS:
        assert ours.encode(text) == reference.encode(text, add_special_tokens=False), text
    assert ours.eos_token_id == 2
    chat = ours.apply_chat_template([{"role": "user", "content": "hi"}])
    assert chat.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")


def test_a_hugging_face_directory_loads_by_path(model_dir, llm):
    by_path = LLM(
        model=str(model_dir), num_threads=2, device="cpu", num_blocks=64, quantization="none"
    )
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    prompt = "The capital of France is"
    assert (
        by_path.generate([prompt], params)[0].token_ids
        == llm.generate([prompt], params)[0].token_ids
    )
