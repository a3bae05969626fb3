"""How close a quantized engine stays to the fp32 one, and why it is not closer: teacher-forced
top-1 agreement over 12 prompts x 32 tokens, for the weights rounded several ways.

    python -m bench.quant_quality [--threads 2]

The measurement (engine/quality.py, also what tests/engine/test_quantization.py asserts): at
each position of the fp32 engine's greedy continuation, the other engine's argmax given fp32's
own prefix. A flip can only happen where fp32's top two logits are close, so each flip is listed
with fp32's margin there (top-1 minus top-2 log-probability, the same as the logit difference).

The ladder rounds the fp32 decoder weights, then runs the fp32 engine on them: the engine's own
int8 quantizer (what a quantized engine's prefill computes: chunks of more than 64 rows run one
float GEMM of the dequantized weight), the int4 min/max codes, int8 with a scale per group of
inputs (what-ifs that no kernel here runs), and plain bf16 / fp16 rounding. Then the int4 engine
itself, as its prompt chunks compute (a float GEMM of the codes' values) and as its decode steps
do (the C++ codes kernels, which round the activations to int16 per 32 inputs), the latter by
running those kernels on every step. What it leaves out is the bf16 activations of the int8
kernel, which only decode steps run. Then the same for
the KV cache: the engine's int8 cache (rotated rows, engine/kv_quant.py), and what-ifs that round
K and V on their way into the fp32 cache (one int8 scale per plain row, bf16).

Flips are few and land on near-ties, so their count is noisy; the noise itself is measured too:
the RMS over all positions of how much fp32's top-2 margin moved (the other engine's log-prob
difference between fp32's top two tokens, minus fp32's). A flip needs that move to exceed the
margin.

Prints a table, then a JSON summary as the last line: per rounding the agreement, the number of
flips and fp32's margin at each, the RMS margin move, and how many positions fp32 itself decides
by less than 0.1 and 0.3 (in log-probability)."""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

import engine.model as engine_model
from engine import LLM
from engine.model import DecoderLayer
from engine.quality import (
    PROMPTS,
    codes_kernels_on_every_step,
    greedy_continuations,
    teacher_forced_top,
)
from engine.quantization import (
    PackedWeight,
    int4_groups,
    int8_last_dim,
    pack,
    quantize_int8,
)

NEAR_TIE_MARGINS = (0.1, 0.3)


def margin_moves(reference: list[dict[int, float]], other: list[dict[int, float]]) -> list[float]:
    """Per position, how far the other engine moved fp32's top-2 margin (a token outside its
    top list counts at the list's lowest log-probability)."""
    moves = []
    for ref, got in zip(reference, other, strict=True):
        first, second = sorted(ref, key=ref.__getitem__, reverse=True)[:2]
        floor = min(got.values())
        moved = got.get(first, floor) - got.get(second, floor)
        moves.append(moved - (ref[first] - ref[second]))
    return moves


def int8_rows(w: torch.Tensor) -> torch.Tensor:
    q = quantize_int8(w)
    return q.qweight.float() * q.scales.float()[:, None]


def int8_groups(size: int) -> Callable[[torch.Tensor], torch.Tensor]:
    def rounded(w: torch.Tensor) -> torch.Tensor:
        n, k = w.shape
        return int8_last_dim(w.float().view(n, k // size, size)).view(n, k)

    return rounded


def int4_codes(w: torch.Tensor) -> torch.Tensor:
    q, scale, low = int4_groups(w)
    n, k = w.shape
    groups = q.float().view(n, scale.shape[1], -1)
    return (groups * scale[..., None] + low[..., None]).view(n, k)


ROUNDINGS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "int8 per row (the engine's)": int8_rows,
    "int8 per 192 inputs": int8_groups(192),
    "int8 per 64 inputs": int8_groups(64),
    "int8 per 32 inputs": int8_groups(32),
    "int4 min/max per 32 (the engine's codes)": int4_codes,
    "bf16": lambda w: w.bfloat16().float(),
    "fp16": lambda w: w.half().float(),
}


LINEARS = ("qkv_weight", "o_weight", "gate_up_weight", "down_weight")


def plain_weights(layers: list[DecoderLayer]) -> list[list[torch.Tensor]]:
    """Each layer's linear weights as plain tensors (a packed weight keeps its plain copy)."""
    return [
        [
            w.plain if isinstance(w, PackedWeight) else w
            for w in map(layer.__getattribute__, LINEARS)
        ]
        for layer in layers
    ]


def set_weights(layers: list[DecoderLayer], weights: list[list[torch.Tensor]]) -> None:
    """The layers' linear weights, prepared as the fp32 engine prepares them (engine.pack)."""
    for layer, plain in zip(layers, weights, strict=True):
        for name, w in zip(LINEARS, plain, strict=True):
            setattr(layer, name, pack(w))


# K and V rows rounded on their way into the fp32 cache. int8_last_dim: one scale per row, not
# rotated (the int8 cache before the rotation).
KV_ROUNDINGS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "KV int8, one scale per plain row": int8_last_dim,
    "KV bf16": lambda x: x.bfloat16().float(),
}


@contextmanager
def rounded_kv(llm: LLM, rounding: Callable[[torch.Tensor], torch.Tensor]) -> Iterator[None]:
    """The fp32 engine with every new K and V row rounded on its way into the cache (what the
    layers read back, like a quantized cache's rows). The layers run their torch steps, whose
    KV store is write_kv (the fused CPU steps store K and V themselves)."""
    model = llm.engine.runner.model
    write_kv, fused_ops = engine_model.write_kv, model.fused_ops
    engine_model.write_kv = lambda cache, meta, k, v: write_kv(cache, meta, rounding(k),
                                                               rounding(v))  # fmt: skip
    model.fused_ops = model.torch_ops
    try:
        yield
    finally:
        engine_model.write_kv, model.fused_ops = write_kv, fused_ops


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    llm = LLM(num_threads=args.threads, quantization="none")  # the fp32 reference
    prompts = [llm.tokenizer.encode(p) for p in PROMPTS]
    reference, margins = greedy_continuations(llm, prompts)
    expected = [t for cont in reference for t in cont]
    _, fp32_top = teacher_forced_top(llm, prompts, reference)
    results: dict[str, dict] = {}

    def measure(name: str, other: LLM) -> None:
        forced, top = teacher_forced_top(other, prompts, reference)
        flips = [i for i, (a, b) in enumerate(zip(forced, expected, strict=True)) if a != b]
        moves = margin_moves(fp32_top, top)
        results[name] = {
            "agreement": round(1 - len(flips) / len(expected), 4),
            "flips": len(flips),
            "fp32_margins_at_flips": sorted(round(margins[i], 3) for i in flips),
            "rms_margin_move": round(math.sqrt(sum(m * m for m in moves) / len(moves)), 4),
        }
        r = results[name]
        print(
            f"{name:42s} agreement {r['agreement']:.4f}  flips {len(flips):2d}  "
            f"rms margin move {r['rms_margin_move']:.4f}  "
            f"fp32 margins {r['fp32_margins_at_flips']}",
            flush=True,
        )

    layers = llm.engine.runner.model.layers
    originals = plain_weights(layers)
    for name, rounding in ROUNDINGS.items():
        set_weights(layers, [[rounding(w) for w in ws] for ws in originals])
        measure(name, llm)
    set_weights(layers, originals)
    for name, rounding in KV_ROUNDINGS.items():
        with rounded_kv(llm, rounding):
            measure(name, llm)
    int4 = LLM(num_threads=args.threads, quantization="int4")
    measure("int4 engine, prompt chunks (float GEMM)", int4)
    with codes_kernels_on_every_step():
        measure("int4 engine, decode steps (codes kernels)", int4)
    del int4
    measure("KV int8, rotated rows (the engine's)", LLM(num_threads=args.threads,
                                                        kv_cache_dtype="int8",
                                                        quantization="none"))  # fmt: skip
    summary = {
        "positions": len(expected),
        "fp32_positions_with_margin_below": {
            str(m): sum(x < m for x in margins) for m in NEAR_TIE_MARGINS
        },
        "roundings": results,
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
