"""Engine vs Hugging Face transformers: prefill and decode tokens/s, fp32 and bf16, and the roof.

Usage: python bench/engine.py [--quick] [--dtypes float32] [--profile] (--help for the rest).
On a CPU without native bf16 matmul (AVX2), bf16 runs at ~1/7 of the fp32 speed, and the bf16
points dominate: the default run then takes ~10-12 minutes on 2 shared cores, --quick ~4.

Prints tables, then one JSON line (the last line of stdout):
{"prefill_speedup_vs_hf": {"float32": {"128": r, "512": r, ...}, "bfloat16": {...}},
 "decode_speedup_vs_hf": {"float32": {"1": r, "8": r, "32": r}, "bfloat16": {...}},
 "prefill_tokens_per_s": {"engine": {dtype: {n: x}}, "hf": {...}},
 "decode_tokens_per_s": {"engine": {dtype: {batch: x}}, "hf": {...}},
 "roof_gflops": {dtype: x}, "prefill_gflops": {...}, "prefill_fraction_of_roof": {...},
 "targets": {name: {"value": x, "target": y, "met": bool}}, "setup": {...},
 "decode_int8_vs_hf_fp32": {"1": r, "32": r}, "decode_int8_tokens_per_s": {...},
 "decode_int4_vs_hf_fp32": {"1": r, "32": r}, "decode_int4_tokens_per_s": {...},
 "decode_int8_kv_vs_hf_fp32": {"1": r, "32": r}, "decode_int8_kv_tokens_per_s": {...},
 "decode_int8_kv_vs_engine_fp32": {"1": r, "32": r} (the fp32 engine with an int8 KV cache),
 "kv_bytes_per_token": {"float32": n, "bfloat16": n, "int8": n}, "read_bandwidth_gb_s": x,
 "decode_b1_fraction_of_bandwidth_bound": {"float32": {...}, "int8": {...}, "int4": {...}},
 "decode_ms_per_token_by_context": {"1": {"16": ms, "256": ms, "1024": ms, "2048": ms},
 "32": {...}}, "decode_context_setup": {"quantization": q, "attention": backend},
 "decode_b1_context_fraction_of_bytes_bound": {"16": f, ...}, "decode_context_2048_vs_16":
 {"1": r, "32": r}}
--decode-only skips prefill; --no-int8 / --no-int4 / --no-int8-kv / --no-context skip those
points.

How each number is made. Both systems run in the same process, one after the other, alternating
which goes first, so that load from other processes hits them alike; each number is the best
(shortest) time of the repeats.
- prefill of n tokens: the prompt's KV cache plus its last-position logits. Engine:
  generate(max_tokens=1) with chunk_size >= n (one step); HF: one forward with use_cache=True and
  logits_to_keep=1 (what HF's own generate does for a prompt).
- decode at batch B: B prompts of 32 tokens, G new tokens each; tokens/s = B * (G - 1) / the
  time from the moment every prompt has its first token to the end, so prefill is excluded
  (timing t(G) - t(1) instead subtracts two noisy runs, which on a shared machine can go
  negative). Engine: its own step loop; HF: batched model.generate, greedy, EOS off, with a
  streamer that notes the first token's time.
- decode by context: the engine as a user gets it here (quantization auto, the default
  attention backend), B prompts of context - 1 tokens, then G - 1 timed steps: ms per step, which
  is each request's time per output token. Its bytes bound at batch 1 is (the step's weight bytes
  + context x KV bytes per token) / read bandwidth; the fraction is bound / measured.
- roof: F.linear of [2048, 2048] by a [2048, 2048] weight, the [out, in] layout every layer uses.
- model FLOPs from config.json: 2 * (matmul weights of the layers) per token, one lm_head row,
  and causal attention 4 * layers * heads * head_dim * n(n+1)/2 (QK^T and PV over the keys each
  query sees).
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import itertools
import json
import os
import pstats
import sys
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from functools import partial
from pathlib import Path

# This file shares its name with the package it measures: drop the script's own folder from the
# import path so that `import engine` finds the package, not this file.
_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]
sys.path.insert(0, str(_HERE.parent))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from engine import LLM, SamplingParams  # noqa: E402
from engine.kv_quant import SCALE_BYTES as KV_SCALE_BYTES  # noqa: E402
from engine.model_files import resolve_model  # noqa: E402
from engine.quantization import INT4_GROUP  # noqa: E402

MODEL = "smollm2-135m"
DTYPES = ("float32", "bfloat16")
PREFILL_SIZES = (128, 512, 1024, 2048)
DECODE_BATCHES = (1, 8, 32, 64)
DECODE_PROMPT_TOKENS = 32
NEW_TOKENS = 9  # G: the first token ends the prefill, then G - 1 = 8 decode steps
REPEATS = 3
BUDGET_S = 20.0
QUICK_PREFILL_SIZES = (128, 512)
QUICK_DECODE_BATCHES = (1, 32)
QUICK_NEW_TOKENS = 5
QUICK_REPEATS = 2
BLOCK_SIZE = 16  # the engine's default
KV_WATERMARK = 0.85  # the engine admits requests only while this fraction of blocks is in use
ROOF_SIZE = 2048
ROOF_REPEATS = {"float32": 8, "bfloat16": 4}  # bf16 is slow where the CPU lacks native bf16
EOS_AND_PAD_ID = 2
# The speed targets: bf16 prefill at 512-2048 tokens vs HF and vs the roof, fp32 prefill vs
# HF, decode at batch 32 vs HF's batched generate.
TARGET_BF16_PREFILL_SPEEDUP = 1.5
TARGET_BF16_PREFILL_ROOF_FRACTION = 0.70
TARGET_FP32_PREFILL_SPEEDUP = 1.0
TARGET_DECODE_B32_SPEEDUP = 3.0
LONG_PROMPTS = (512, 1024, 2048)
# The decode targets: fp32 at batch 1 and 32 vs HF, int8 weights at batch 1 vs HF fp32.
TARGET_FP32_DECODE_B1_SPEEDUP = 2.0
TARGET_FP32_DECODE_B32_SPEEDUP = 1.5
TARGET_INT8_DECODE_B1_SPEEDUP = 4.0
INT8_DECODE_BATCHES = (1, 32)  # the int4 points too
QUANTIZED = ("int8", "int4")  # weight quantizations benchmarked against HF fp32
# Every engine variant benchmarked against HF fp32: its engine settings (int8_kv: the fp32
# engine with an int8 KV cache).
VARIANTS: dict[str, dict[str, str]] = {
    "int8": {"quantization": "int8"},
    "int4": {"quantization": "int4"},
    "int8_kv": {"kv_cache_dtype": "int8"},
}
# Decode by context: the engine's default quantization, step time at each context length.
DECODE_CONTEXTS = (16, 256, 1024, 2048)
CONTEXT_BATCHES = (1, 32)
BANDWIDTH_BYTES = 512 * 2**20  # well past the last-level cache: every read comes from DRAM
BANDWIDTH_REPEATS = 5

_request_ids = itertools.count()
# Wraps the timed part of a measurement: nullcontext, or a profiler.
Around = Callable[[], AbstractContextManager]


@dataclass(frozen=True, slots=True)
class FlopModel:
    """Forward FLOPs of a Llama-family model, from its config.json."""

    num_layers: int
    layer_matmul_params: int  # q, k, v, o, gate, up, down of one layer
    lm_head_params: int
    layer_matmul_rows: int  # output channels of one layer's matmuls (one int8 scale each)
    attention_width: int  # num_heads * head_dim
    vocab_size: int
    kv_elements_per_token: int  # layers * (K and V) * kv heads * head_dim
    kv_heads_per_token: int  # layers * (K and V) * kv heads: one scale each in an int8 cache

    @classmethod
    def from_dir(cls, model_dir: Path) -> FlopModel:
        c = json.loads((model_dir / "config.json").read_text())
        hidden, heads = c["hidden_size"], c["num_attention_heads"]
        head_dim = c.get("head_dim") or hidden // heads
        q_width, kv_width = heads * head_dim, c.get("num_key_value_heads", heads) * head_dim
        attn = hidden * (q_width + 2 * kv_width) + q_width * hidden
        return cls(
            num_layers=c["num_hidden_layers"],
            layer_matmul_params=attn + 3 * hidden * c["intermediate_size"],
            lm_head_params=c["vocab_size"] * hidden,
            layer_matmul_rows=q_width + 2 * kv_width + 2 * hidden + 2 * c["intermediate_size"],
            attention_width=q_width,
            vocab_size=c["vocab_size"],
            kv_elements_per_token=c["num_hidden_layers"] * 2 * kv_width,
            kv_heads_per_token=c["num_hidden_layers"] * 2 * (kv_width // head_dim),
        )

    def kv_bytes_per_token(self) -> dict[str, int]:
        """What one token's KV takes in the cache (and on the wire) per cache dtype; int8
        counts its scales (computed from the layout: the int8 cache itself is not built)."""
        n = self.kv_elements_per_token
        int8 = n + self.kv_heads_per_token * KV_SCALE_BYTES
        return {"float32": 4 * n, "bfloat16": 2 * n, "int8": int8}

    def decode_weight_bytes(self, quantization: str) -> int:
        """Weight bytes one decode step reads: every layer's matmuls and the lm_head (fp32; or
        int8 layers with one bf16 scale per output row, or int4 layers with a float32 scale and
        min per group of 32; with either, the bundled model's lm_head as its Q8_0 codes with a
        float32 scale per 32)."""
        layers = self.num_layers * self.layer_matmul_params
        if quantization not in QUANTIZED:  # float32 ("none")
            return 4 * layers + 4 * self.lm_head_params
        head = self.lm_head_params + 4 * self.lm_head_params // INT4_GROUP
        if quantization == "int8":
            return layers + 2 * self.num_layers * self.layer_matmul_rows + head
        return layers // 2 + 2 * 4 * layers // INT4_GROUP + head

    def gflop_per_token(self) -> float:
        """Matmul cost of one token with its own logits (attention excluded)."""
        return 2 * (self.num_layers * self.layer_matmul_params + self.lm_head_params) / 1e9

    def prefill_flops(self, n: int) -> float:
        matmuls = 2 * self.num_layers * self.layer_matmul_params * n + 2 * self.lm_head_params
        attention = 4 * self.num_layers * self.attention_width * n * (n + 1) // 2
        return float(matmuls + attention)


# ---- timing ---------------------------------------------------------------------------------


def timed(fn: Callable[[], object]) -> float:
    gc.collect()
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def best_times(fns: list[Callable[[], float]], repeats: int, budget_s: float) -> list[float]:
    """Best (smallest) of the seconds each fn reports, over rounds that call them all, rotating
    who goes first; rounds stop after `repeats`, or once `budget_s` is spent (at least one)."""
    best = [float("inf")] * len(fns)
    started = time.perf_counter()
    for round_index in range(repeats):
        if round_index > 0 and time.perf_counter() - started > budget_s:
            break
        for k in range(len(fns)):
            i = (k + round_index) % len(fns)
            best[i] = min(best[i], fns[i]())
    return best


def measure_roof(dtype: torch.dtype, repeats: int) -> float:
    """GFLOP/s of one large matmul in the weight layout the models use (best of the repeats)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(ROOF_SIZE, ROOF_SIZE, generator=g).to(dtype)
    w = torch.randn(ROOF_SIZE, ROOF_SIZE, generator=g).to(dtype)
    F.linear(x, w)  # warm-up: library dispatch and buffers
    seconds = min(timed(lambda: F.linear(x, w)) for _ in range(repeats))
    return 2 * ROOF_SIZE**3 / seconds / 1e9


def measure_read_bandwidth() -> float:
    """GB/s of summing a tensor far larger than the caches (best of the repeats): the bound
    a decode step that reads its weights once is held to."""
    data = torch.ones(BANDWIDTH_BYTES // 4)
    data.sum()
    seconds = min(timed(data.sum) for _ in range(BANDWIDTH_REPEATS))
    return BANDWIDTH_BYTES / seconds / 1e9


# ---- the two systems ------------------------------------------------------------------------


def make_llm(dtype: str, threads: int, num_blocks: int, **variant: str) -> LLM:
    """variant: quantization= and/or kv_cache_dtype= (VARIANTS). Without a quantization the
    weights are the dequantized dtype ones (quantization none, not the CPU's int4 default):
    the engine-vs-HF points compare the same arithmetic."""
    return LLM(
        model=MODEL,
        dtype=dtype,
        chunk_size=max(PREFILL_SIZES),
        num_blocks=num_blocks,
        num_threads=threads,
        enable_prefix_caching=False,
        **{"quantization": "none", **variant},
    )


class Systems:
    """The engine and the HF model at one dtype, with the same calls on both."""

    def __init__(self, dtype: str, threads: int, num_blocks: int) -> None:
        from transformers import AutoModelForCausalLM

        self.llm = make_llm(dtype, threads, num_blocks)
        torch_dtype = getattr(torch, dtype)
        self.hf = AutoModelForCausalLM.from_pretrained(resolve_model(MODEL), dtype=torch_dtype)
        self.hf.eval()
        self.hf.generation_config.eos_token_id = None  # generate exactly the tokens asked for
        self.hf.generation_config.pad_token_id = EOS_AND_PAD_ID

    def engine_generate(self, prompts: list[list[int]], num_new: int) -> None:
        params = SamplingParams(max_tokens=num_new, temperature=0.0, ignore_eos=True)
        outputs = self.llm.generate(prompts, params)
        assert all(len(o.token_ids) == num_new for o in outputs)

    def engine_prefill_s(self, prompt: list[int], around: Around = nullcontext) -> float:
        gc.collect()
        with around():
            started = time.perf_counter()
            self.engine_generate([prompt], 1)
            return time.perf_counter() - started

    def engine_decode_s(
        self, prompts: list[list[int]], num_new: int, around: Around = nullcontext
    ) -> float:
        return engine_decode_s(self.llm, prompts, num_new, around)

    @torch.inference_mode()
    def hf_prefill_s(self, prompt: list[int]) -> float:
        input_ids = torch.tensor([prompt])
        gc.collect()
        started = time.perf_counter()
        out = self.hf(input_ids, use_cache=True, logits_to_keep=1)
        seconds = time.perf_counter() - started
        assert out.logits.shape[1] == 1 and out.past_key_values is not None
        return seconds

    @torch.inference_mode()
    def hf_decode_s(self, prompts: list[list[int]], num_new: int) -> float:
        """Seconds from the first generated token to the end of a batched generate."""
        # Prompts have equal lengths, so the batch needs no padding; the mask is all ones.
        input_ids = torch.tensor(prompts)
        clock = _FirstTokenClock()
        gc.collect()
        out = self.hf.generate(
            input_ids=input_ids,
            attention_mask=torch.ones_like(input_ids),
            do_sample=False,
            min_new_tokens=num_new,
            max_new_tokens=num_new,
            pad_token_id=EOS_AND_PAD_ID,
            streamer=clock,
        )
        seconds = time.perf_counter() - clock.first_token_s
        assert out.shape == (len(prompts), input_ids.shape[1] + num_new)
        assert clock.num_puts == 1 + num_new
        return seconds

    def warm_up(self, prompt: list[int]) -> None:
        self.engine_prefill_s(prompt)
        self.engine_decode_s([prompt], 3)
        self.hf_prefill_s(prompt)
        self.hf_decode_s([prompt], 3)


def engine_decode_s(
    llm: LLM, prompts: list[list[int]], num_new: int, around: Around = nullcontext
) -> float:
    """Seconds of the num_new - 1 steps after every prompt has its first token."""
    engine = llm.engine
    params = SamplingParams(max_tokens=num_new, temperature=0.0, ignore_eos=True)
    requests = [engine.add_request(f"bench-{next(_request_ids)}", p, params) for p in prompts]
    while any(r.num_output_tokens == 0 for r in requests):
        engine.step()
    gc.collect()
    with around():
        first_token_s = time.perf_counter()
        while engine.has_unfinished_requests():
            engine.step()
        seconds = time.perf_counter() - first_token_s
    assert all(r.num_output_tokens == num_new for r in requests)
    return seconds


class _FirstTokenClock:
    """An HF generate streamer that notes when the first new token exists: generate puts the
    prompt, then each step's new tokens."""

    def __init__(self) -> None:
        self.num_puts = 0
        self.first_token_s = 0.0

    def put(self, _token_ids: torch.Tensor) -> None:
        self.num_puts += 1
        if self.num_puts == 2:
            self.first_token_s = time.perf_counter()

    def end(self) -> None:
        pass


def num_blocks_needed(max_prompt: int, max_batch: int, new_tokens: int) -> int:
    """KV blocks for the longest prompt alone, and for the largest decode batch admitted at
    once and run to the end without preemption (which would time recompute, not decode)."""
    blocks_per_decode = -(-(DECODE_PROMPT_TOKENS + new_tokens) // BLOCK_SIZE)
    decode = max_batch * blocks_per_decode / KV_WATERMARK
    prefill = -(-(max_prompt + 1) // BLOCK_SIZE)
    return int(max(decode, prefill)) + 1


def random_prompts(num: int, length: int, vocab_size: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(100, vocab_size, (num, length), generator=g).tolist()


def bench_prefill(
    systems: Systems, sizes: list[int], repeats: int, budget_s: float, vocab: int
) -> dict[int, tuple[float, float]]:
    """n -> (engine seconds, HF seconds) for one n-token prefill."""
    results = {}
    for n in sizes:
        (prompt,) = random_prompts(1, n, vocab, seed=n)
        engine_s, hf_s = best_times(
            [partial(systems.engine_prefill_s, prompt), partial(systems.hf_prefill_s, prompt)],
            repeats,
            budget_s,
        )
        results[n] = (engine_s, hf_s)
        print(f"  prefill {n:>5} tokens: engine {engine_s:7.3f} s, hf {hf_s:7.3f} s", flush=True)
    return results


def bench_decode(
    systems: Systems, batches: list[int], num_new: int, repeats: int, budget_s: float, vocab: int
) -> dict[int, tuple[float, float]]:
    """batch -> (engine decode tokens/s, HF decode tokens/s), prefill and first token excluded."""
    results = {}
    for batch in batches:
        prompts = random_prompts(batch, DECODE_PROMPT_TOKENS, vocab, seed=batch)
        engine_s, hf_s = best_times(
            [
                partial(systems.engine_decode_s, prompts, num_new),
                partial(systems.hf_decode_s, prompts, num_new),
            ],
            repeats,
            budget_s,
        )
        num_decoded = batch * (num_new - 1)
        results[batch] = (num_decoded / engine_s, num_decoded / hf_s)
        print(
            f"  decode batch {batch:>3}: engine {engine_s:6.2f} s, hf {hf_s:6.2f} s"
            f" for {num_new - 1} steps",
            flush=True,
        )
    return results


def bench_quantized_decode(
    systems: Systems, args: argparse.Namespace, num_blocks: int, vocab: int, quantization: str
) -> dict[int, tuple[float, float]]:
    """Quantized-weight (int8 or int4) engine decode vs HF fp32, interleaved like the others."""
    fp32_llm = systems.llm
    systems.llm = make_llm("float32", args.threads, num_blocks, **VARIANTS[quantization])
    try:
        systems.engine_decode_s(random_prompts(1, DECODE_PROMPT_TOKENS, vocab, seed=7), 3)
        print(f"  {quantization}:", flush=True)
        return bench_decode(
            systems, list(INT8_DECODE_BATCHES), args.new_tokens, args.repeats, args.budget_s, vocab
        )
    finally:
        systems.llm = fp32_llm


def add_quantized_decode_keys(
    summary: dict, decode: dict, quantized: dict[str, dict], flops: FlopModel, bandwidth: float
) -> None:
    """Int8- and int4-weight decode vs HF fp32, KV bytes per token, and batch 1 against the
    bandwidth bound (weight bytes per step / read bandwidth); "int8" and "int4" are
    quantizations, not dtypes, so they stay out of the per-dtype keys."""
    for name in VARIANTS:
        points = quantized.get(name, {})
        summary[f"decode_{name}_vs_hf_fp32"] = {
            str(b): round(e / h, 3) for b, (e, h) in points.items()
        }
        summary[f"decode_{name}_tokens_per_s"] = {
            str(b): {f"engine_{name}": round(e, 3), "hf_fp32": round(h, 3)}
            for b, (e, h) in points.items()
        }
    # int8 KV against this run's fp32 engine (same weights, only the cache differs).
    fp32 = decode.get("float32", {})
    summary["decode_int8_kv_vs_engine_fp32"] = {
        str(b): round(e / fp32[b][0], 3) for b, (e, _) in quantized.get("int8_kv", {}).items()
        if b in fp32
    }  # fmt: skip
    summary["kv_bytes_per_token"] = flops.kv_bytes_per_token()
    summary["read_bandwidth_gb_s"] = round(bandwidth, 2)
    fraction = {}
    batch1 = {"float32": decode.get("float32", {}).get(1)}
    batch1.update({name: quantized.get(name, {}).get(1) for name in QUANTIZED})
    for name, tps in batch1.items():
        if tps is not None:
            bound = bandwidth * 1e9 / flops.decode_weight_bytes(name)
            fraction[name] = {"tokens_per_s": round(tps[0], 2), "bound": round(bound, 1),
                              "fraction": round(tps[0] / bound, 3)}  # fmt: skip
    summary["decode_b1_fraction_of_bandwidth_bound"] = fraction
    checks = summary["targets"]
    fp32 = summary["decode_speedup_vs_hf"].get("float32", {})
    for name, value, target in (
        ("fp32_decode_b1_vs_hf", fp32.get("1"), TARGET_FP32_DECODE_B1_SPEEDUP),
        ("fp32_decode_b32_vs_hf", fp32.get("32"), TARGET_FP32_DECODE_B32_SPEEDUP),
        ("int8_decode_b1_vs_hf_fp32", summary["decode_int8_vs_hf_fp32"].get("1"),
         TARGET_INT8_DECODE_B1_SPEEDUP),
    ):  # fmt: skip
        if value is not None:
            checks[name] = {"value": value, "target": target, "met": value >= target}


def bench_decode_by_context(
    args: argparse.Namespace, flops: FlopModel, bandwidth: float, vocab: int
) -> dict:
    """Decode step time (each request's time per output token) at each context length and
    batch, for the engine's default quantization here, and batch 1 against its bytes bound:
    (weight bytes + the context's KV bytes) / read bandwidth."""
    batches, contexts = args.context_batches, args.contexts
    longest = max(contexts) + args.new_tokens
    num_blocks = int(max(batches) * -(-longest // BLOCK_SIZE) / KV_WATERMARK) + 1
    llm = LLM(
        model=MODEL, dtype="float32", chunk_size=max(PREFILL_SIZES), num_blocks=num_blocks,
        num_threads=args.threads, enable_prefix_caching=False, quantization="auto",
        max_num_seqs=max(batches),
    )  # fmt: skip
    quantization = llm.engine.config.quantization
    attention = llm.engine.runner.attention.name
    engine_decode_s(llm, random_prompts(1, 32, vocab, seed=7), 3)  # warm-up
    ms: dict[str, dict[str, float]] = {}
    for batch in batches:
        for context in contexts:
            # Prompts of context - 1 tokens: the timed steps run at context .. context + G - 2.
            prompts = random_prompts(batch, max(1, context - 1), vocab, seed=context + batch)
            repeats = args.repeats if batch == 1 else 1  # a batch of long prompts: one round
            (seconds,) = best_times(
                [partial(engine_decode_s, llm, prompts, args.new_tokens)], repeats, args.budget_s
            )
            step_ms = seconds / (args.new_tokens - 1) * 1e3
            ms.setdefault(str(batch), {})[str(context)] = round(step_ms, 2)
            print(f"  decode batch {batch:>3} at context {context:>5}: {step_ms:7.2f} ms/token")
    kv_bytes = flops.kv_bytes_per_token()["float32"]
    weights = flops.decode_weight_bytes(quantization)
    fraction = {
        c: round((weights + int(c) * kv_bytes) / (bandwidth * 1e9) * 1e3 / t, 3)
        for c, t in ms.get("1", {}).items()
    }
    first, last = str(min(contexts)), str(max(contexts))
    del llm
    gc.collect()
    return {
        "decode_ms_per_token_by_context": ms,
        "decode_context_setup": {"quantization": quantization, "attention": attention},
        "decode_b1_context_fraction_of_bytes_bound": fraction,
        f"decode_context_{last}_vs_{first}": {
            b: round(r[last] / r[first], 3) for b, r in ms.items()
        },
    }


# ---- reporting ------------------------------------------------------------------------------


def targets(summary: dict) -> dict[str, dict]:
    """The speed targets over whatever was measured (a target with no data is left out)."""
    prefill, frac = summary["prefill_speedup_vs_hf"], summary["prefill_fraction_of_roof"]["engine"]
    decode = summary["decode_speedup_vs_hf"]
    checks: dict[str, tuple[list[float], float]] = {
        "bf16_prefill_vs_hf_512_2048": (
            [r for n, r in prefill.get("bfloat16", {}).items() if int(n) in LONG_PROMPTS],
            TARGET_BF16_PREFILL_SPEEDUP,
        ),
        "bf16_prefill_fraction_of_roof_512_2048": (
            [f for n, f in frac.get("bfloat16", {}).items() if int(n) in LONG_PROMPTS],
            TARGET_BF16_PREFILL_ROOF_FRACTION,
        ),
        "fp32_prefill_vs_hf": (
            list(prefill.get("float32", {}).values()),
            TARGET_FP32_PREFILL_SPEEDUP,
        ),
    }
    for dtype, ratios in decode.items():
        checks[f"decode_b32_vs_hf_{dtype}"] = (
            [ratios["32"]] if "32" in ratios else [],
            TARGET_DECODE_B32_SPEEDUP,
        )
    # The worst measured point decides.
    return {
        name: {"value": round(min(values), 3), "target": target, "met": min(values) >= target}
        for name, (values, target) in checks.items()
        if values
    }


def summarize(
    roof: dict[str, float],
    prefill: dict[str, dict[int, tuple[float, float]]],
    decode: dict[str, dict[int, tuple[float, float]]],
    flops: FlopModel,
    setup: dict,
) -> dict:
    def per_system(fn: Callable[[int, float], float], data: dict, index: int) -> dict:
        return {
            d: {str(k): round(fn(k, v[index]), 3) for k, v in rows.items()}
            for d, rows in data.items()
        }

    prefill_tps = {
        name: per_system(lambda n, s: n / s, prefill, i) for i, name in enumerate(("engine", "hf"))
    }
    prefill_gflops = {
        name: per_system(lambda n, s: flops.prefill_flops(n) / s / 1e9, prefill, i)
        for i, name in enumerate(("engine", "hf"))
    }
    summary = {
        "prefill_speedup_vs_hf": {
            d: {str(n): round(hf_s / engine_s, 3) for n, (engine_s, hf_s) in rows.items()}
            for d, rows in prefill.items()
        },
        "decode_speedup_vs_hf": {
            d: {str(b): round(e / h, 3) for b, (e, h) in rows.items()} for d, rows in decode.items()
        },
        "prefill_tokens_per_s": prefill_tps,
        "decode_tokens_per_s": {
            name: per_system(lambda _b, tps: tps, decode, i)
            for i, name in enumerate(("engine", "hf"))
        },
        "roof_gflops": {d: round(g, 1) for d, g in roof.items()},
        "prefill_gflops": prefill_gflops,
        "prefill_fraction_of_roof": {
            name: {
                d: {n: round(g / roof[d], 3) for n, g in rows.items()} for d, rows in data.items()
            }
            for name, data in prefill_gflops.items()
        },
        "setup": setup,
    }
    summary["targets"] = targets(summary)
    return summary


def print_tables(summary: dict) -> None:
    print(f"\nroof GFLOP/s: {summary['roof_gflops']}")
    tps, gflops = summary["prefill_tokens_per_s"], summary["prefill_gflops"]
    frac = summary["prefill_fraction_of_roof"]
    header = "prefill  dtype     tokens  engine tok/s  hf tok/s  speedup  engine GFLOP/s  of roof"
    print(f"\n{header}\n{'-' * len(header)}")
    for d, rows in summary["prefill_speedup_vs_hf"].items():
        for n, speedup in rows.items():
            print(
                f"         {d:<9} {n:>6}  {tps['engine'][d][n]:>12.1f}  {tps['hf'][d][n]:>8.1f}"
                f"  {speedup:>6.2f}x  {gflops['engine'][d][n]:>14.1f}  {frac['engine'][d][n]:>6.1%}"
            )
    dtps = summary["decode_tokens_per_s"]
    header = "decode   dtype      batch  engine tok/s  hf tok/s  speedup"
    print(f"\n{header}\n{'-' * len(header)}")
    for d, rows in summary["decode_speedup_vs_hf"].items():
        for b, speedup in rows.items():
            print(
                f"         {d:<9} {b:>6}  {dtps['engine'][d][b]:>12.1f}  {dtps['hf'][d][b]:>8.1f}"
                f"  {speedup:>6.2f}x"
            )
    roof = summary["roof_gflops"]
    if roof.get("bfloat16", 0.0) < roof.get("float32", 0.0):
        print(
            "\nnote: the bf16 roof is below the fp32 one: this CPU has no native bf16 matmul"
            f" (capability {summary['setup']['cpu_capability']}), so bf16 weights computed in"
            " fp32 would run faster than bf16 arithmetic"
        )
    print("\ntargets:")
    for name, t in summary["targets"].items():
        verdict = "met" if t["met"] else "MISSED"
        print(f"  {name:<40} {t['value']:>7.3f}  (target {t['target']})  {verdict}")


# ---- profiling ------------------------------------------------------------------------------


def profile_engine(label: str, run: Callable[[Around], float], rows: int) -> None:
    """Where the engine spends its time inside run's timed part: torch operators by self time,
    then Python functions (cProfile) by their own time."""
    from torch.profiler import ProfilerActivity, profile

    run(nullcontext)  # warm-up
    prof = profile(activities=[ProfilerActivity.CPU])
    wall_s = run(lambda: prof)
    averages = prof.key_averages()
    op_s = sum(e.self_cpu_time_total for e in averages) / 1e6
    print(f"\n=== {label}: {wall_s:.3f} s wall, {op_s:.3f} s inside torch operators ===")
    print(averages.table(sort_by="self_cpu_time_total", row_limit=rows))
    profiler = cProfile.Profile()
    run(lambda: profiler)
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(rows)
    print(text.getvalue())


def run_profiles(args: argparse.Namespace, vocab: int) -> None:
    for dtype in args.dtypes:
        num_blocks = num_blocks_needed(args.profile_tokens, args.profile_batch, args.new_tokens)
        systems = Systems(dtype, args.threads, num_blocks)
        (prompt,) = random_prompts(1, args.profile_tokens, vocab, seed=0)
        profile_engine(
            f"engine {dtype} prefill of {args.profile_tokens} tokens",
            partial(systems.engine_prefill_s, prompt),
            args.profile_rows,
        )
        prompts = random_prompts(args.profile_batch, DECODE_PROMPT_TOKENS, vocab, seed=1)
        profile_engine(
            f"engine {dtype} decode at batch {args.profile_batch}: {args.new_tokens - 1} steps",
            partial(systems.engine_decode_s, prompts, args.new_tokens),
            args.profile_rows,
        )
        del systems


# ---- main -----------------------------------------------------------------------------------


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--quick",
        action="store_true",
        help=f"prefill {QUICK_PREFILL_SIZES}, decode batches {QUICK_DECODE_BATCHES}, "
        f"{QUICK_NEW_TOKENS} new tokens, at most {QUICK_REPEATS} rounds per point",
    )
    parser.add_argument("--dtypes", nargs="+", choices=DTYPES, default=list(DTYPES))
    parser.add_argument("--prefill-sizes", nargs="+", type=int, help=f"default {PREFILL_SIZES}")
    parser.add_argument("--decode-batches", nargs="+", type=int, help=f"default {DECODE_BATCHES}")
    parser.add_argument(
        "--new-tokens", type=int, help=f"G, tokens per decode prompt (default {NEW_TOKENS})"
    )
    parser.add_argument("--repeats", type=int, help=f"most rounds per point (default {REPEATS})")
    parser.add_argument(
        "--budget-s",
        type=float,
        default=BUDGET_S,
        help="no further round of a point once its rounds took this long (a slow point gets one)",
    )
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--decode-only", action="store_true", help="no prefill points")
    for name in VARIANTS:
        parser.add_argument(
            f"--no-{name.replace('_', '-')}",
            dest=name,
            action="store_false",
            help=f"skip the {name} decode points (batches {INT8_DECODE_BATCHES}, float32)",
        )
    parser.add_argument(
        "--profile", action="store_true", help="profile the engine instead of benchmarking"
    )
    parser.add_argument(
        "--contexts", nargs="+", type=int, default=list(DECODE_CONTEXTS),
        help="decode step time at these context lengths (default quantization)",
    )  # fmt: skip
    parser.add_argument("--context-batches", nargs="+", type=int, default=list(CONTEXT_BATCHES))
    parser.add_argument("--no-context", dest="context", action="store_false",
                        help="skip the decode-by-context points")  # fmt: skip
    parser.add_argument("--profile-tokens", type=int, default=1024)
    parser.add_argument("--profile-batch", type=int, default=32)
    parser.add_argument("--profile-rows", type=int, default=20)
    args = parser.parse_args()
    quick = args.quick
    args.prefill_sizes = args.prefill_sizes or list(QUICK_PREFILL_SIZES if quick else PREFILL_SIZES)
    args.decode_batches = args.decode_batches or list(
        QUICK_DECODE_BATCHES if quick else DECODE_BATCHES
    )
    args.new_tokens = args.new_tokens or (QUICK_NEW_TOKENS if quick else NEW_TOKENS)
    args.repeats = args.repeats or (QUICK_REPEATS if quick else REPEATS)
    if args.prefill_sizes and not 1 <= min(args.prefill_sizes) <= max(args.prefill_sizes) <= max(
        PREFILL_SIZES
    ):
        parser.error(f"prefill sizes must be in [1, {max(PREFILL_SIZES)}] (one chunk)")
    if max(args.decode_batches) * DECODE_PROMPT_TOKENS > max(PREFILL_SIZES):
        most = max(PREFILL_SIZES) // DECODE_PROMPT_TOKENS
        parser.error(f"decode batches must fit one step: at most {most}")
    if args.decode_only:
        args.prefill_sizes = []
    if args.new_tokens < 2:
        parser.error("--new-tokens must be at least 2: the first token closes the prefill")
    return args


def main() -> None:
    args = parse_args()
    started = time.perf_counter()
    torch.set_num_threads(args.threads)
    flops = FlopModel.from_dir(resolve_model(MODEL))
    vocab = flops.vocab_size
    if args.profile:
        run_profiles(args, vocab)
        return

    load_before = os.getloadavg()[0]
    cpu = torch.backends.cpu.get_cpu_capability()
    print(
        f"{MODEL}: {flops.gflop_per_token():.3f} GFLOP/token of matmuls; torch {torch.__version__}"
        f", CPU capability {cpu}, {args.threads} threads",
        flush=True,
    )
    roof, prefill, decode = {}, {}, {}
    quantized: dict[str, dict[int, tuple[float, float]]] = {}
    bandwidth = measure_read_bandwidth()  # sampled first and last, the best kept
    print(f"read bandwidth {bandwidth:.1f} GB/s", flush=True)
    for dtype in args.dtypes:
        # The roof is sampled before and after this dtype's points and the best kept: one
        # sample can land on a burst of load from other processes.
        roof_repeats = ROOF_REPEATS[dtype] // (2 if args.quick else 1)
        roof[dtype] = measure_roof(getattr(torch, dtype), roof_repeats)
        print(f"{dtype}: roof {roof[dtype]:.1f} GFLOP/s", flush=True)
        num_blocks = num_blocks_needed(
            max(args.prefill_sizes, default=1),
            max(*args.decode_batches, *INT8_DECODE_BATCHES),
            args.new_tokens,
        )
        systems = Systems(dtype, args.threads, num_blocks)
        systems.warm_up(random_prompts(1, 128, vocab, seed=7)[0])
        prefill[dtype] = bench_prefill(
            systems, args.prefill_sizes, args.repeats, args.budget_s, vocab
        )
        decode[dtype] = bench_decode(
            systems, args.decode_batches, args.new_tokens, args.repeats, args.budget_s, vocab
        )
        for name in VARIANTS if dtype == "float32" else ():
            if getattr(args, name):
                quantized[name] = bench_quantized_decode(systems, args, num_blocks, vocab, name)
        del systems
        gc.collect()
        roof[dtype] = max(roof[dtype], measure_roof(getattr(torch, dtype), roof_repeats))

    setup = {
        "model": MODEL,
        "threads": args.threads,
        "cpu_capability": cpu,
        "torch": torch.__version__,
        "repeats": args.repeats,
        "budget_s": args.budget_s,
        "decode_prompt_tokens": DECODE_PROMPT_TOKENS,
        "decode_new_tokens": args.new_tokens,
        "gflop_per_token": round(flops.gflop_per_token(), 4),
        # 1-minute load average before and after: above the thread count, other processes
        # shared the cores and every number is noisier (the ratios less so).
        "load_average": [round(load_before, 2), round(os.getloadavg()[0], 2)],
    }
    bandwidth = max(bandwidth, measure_read_bandwidth())
    summary = summarize(roof, prefill, decode, flops, setup)
    add_quantized_decode_keys(summary, decode, quantized, flops, bandwidth)
    if args.context:
        print("decode by context (default quantization):", flush=True)
        summary.update(bench_decode_by_context(args, flops, bandwidth, vocab))
    print_tables(summary)
    summary["setup"]["seconds"] = round(time.perf_counter() - started, 1)
    print(f"({summary['setup']['seconds']} s, load average {summary['setup']['load_average']})")
    print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
