"""How close a quantized engine stays to the fp32 one, and why it is not closer: teacher-forced
top-1 agreement over 12 prompts x 32 tokens, for the weights rounded several ways.

    python -m bench.quant_quality [--threads 2]

The measurement (also what tests/engine/test_quantization.py asserts): at each position of the
fp32 engine's greedy continuation, the other engine's argmax given fp32's own prefix. A flip can
only happen where fp32's top two logits are close, so each flip is listed with fp32's margin
there (top-1 minus top-2 log-probability, the same as the logit difference).

The ladder rounds the fp32 decoder weights, then runs the fp32 engine on them: the engine's own
int8 quantizer (what a quantized engine's prefill computes: chunks of more than 64 rows run one
float GEMM of the dequantized weight), the int4 min/max codes, int8 with a scale per group of
inputs (what-ifs that no kernel here runs), and plain bf16 / fp16 rounding. What it leaves out is
the bf16 activations of the int8 and int4 kernels, which only decode steps run.

Prints a table, then a JSON summary as the last line: per rounding the agreement, the number of
flips and fp32's margin at each, and how many positions fp32 itself decides by less than 0.1 and
0.3 (in log-probability)."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable

import torch

from engine import LLM, SamplingParams
from engine.model import DecoderLayer
from engine.quantization import INT8_MAX, PackedWeight, int4_groups, pack, quantize_int8

PROMPTS = [
    "The capital of France is",
    "Once upon a time, in a small village,",
    "def fibonacci(n):",
    "The three laws of motion are",
    "List the planets of the solar system in order from the sun:",
    "Write a haiku about autumn leaves falling slowly onto a quiet pond at dusk.",
    "Water boils at a temperature of",
    "The best way to learn a new language is",
    "import numpy as np\n\n# compute the mean of an array",
    "Q: What is the largest mammal on Earth?\nA:",
    "My favourite recipe for pancakes needs",
    "In 1969, the first humans to walk on the Moon",
]
NEW_TOKENS = 32
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
NEAR_TIE_MARGINS = (0.1, 0.3)


def greedy_continuations(llm: LLM, prompts: list[list[int]]) -> tuple[list[list[int]], list[float]]:
    """The engine's greedy continuation of each prompt, and at every position the margin between
    its top two log-probabilities (flattened, prompt-major)."""
    llm.engine.pool.reset_cache()
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True, logprobs=2)
    outputs = llm.generate(prompts, params)
    margins = [lp.top[0][1] - lp.top[1][1] for o in outputs for lp in o.logprobs]
    return [o.token_ids for o in outputs], margins


def teacher_forced(llm: LLM, prompts: list[list[int]], reference: list[list[int]]) -> list[int]:
    """The engine's argmax at each position of the reference continuations, given the
    reference's own prefix (flattened, prompt-major)."""
    prefixes = [
        p + ref[:i] for p, ref in zip(prompts, reference, strict=True) for i in range(len(ref))
    ]
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    llm.engine.pool.reset_cache()
    return [o.token_ids[0] for o in llm.generate(prefixes, one)]


def first_divergences(reference: list[list[int]], other: list[list[int]]) -> list[int | None]:
    """Per prompt, the first position where two free-running continuations part (None: never)."""
    return [
        next((i for i, (a, b) in enumerate(zip(r, o, strict=True)) if a != b), None)
        for r, o in zip(reference, other, strict=True)
    ]


def int8_rows(w: torch.Tensor) -> torch.Tensor:
    q = quantize_int8(w)
    return q.qweight.float() * q.scales.float()[:, None]


def int8_groups(size: int) -> Callable[[torch.Tensor], torch.Tensor]:
    def rounded(w: torch.Tensor) -> torch.Tensor:
        n, k = w.shape
        groups = w.float().view(n, k // size, size)
        scale = (groups.abs().amax(dim=-1, keepdim=True) / INT8_MAX).clamp_min(1e-12)
        return (torch.round(groups / scale).clamp(-INT8_MAX, INT8_MAX) * scale).view(n, k)

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    llm = LLM(num_threads=args.threads)
    prompts = [llm.tokenizer.encode(p) for p in PROMPTS]
    reference, margins = greedy_continuations(llm, prompts)
    expected = [t for cont in reference for t in cont]
    layers = llm.engine.runner.model.layers
    originals = plain_weights(layers)
    results: dict[str, dict] = {}
    for name, rounding in ROUNDINGS.items():
        set_weights(layers, [[rounding(w) for w in ws] for ws in originals])
        forced = teacher_forced(llm, prompts, reference)
        flips = [i for i, (a, b) in enumerate(zip(forced, expected, strict=True)) if a != b]
        results[name] = {
            "agreement": round(1 - len(flips) / len(expected), 4),
            "flips": len(flips),
            "fp32_margins_at_flips": sorted(round(margins[i], 3) for i in flips),
        }
        print(
            f"{name:42s} agreement {results[name]['agreement']:.4f}  flips {len(flips):2d}  "
            f"fp32 margins {results[name]['fp32_margins_at_flips']}",
            flush=True,
        )
    set_weights(layers, originals)
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
