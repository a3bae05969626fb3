"""What structured output costs: llguidance's mask for a constrained batch per decode step,
against the same engine's unconstrained decode step measured in the same run; and the
one-off costs (the vocabulary, a schema's grammar, a request's matcher).

Run from the repository root as `python -m bench.structured_output` (bench/engine.py would
shadow the engine package if run as a script). Prints a table, then one JSON line (the last
line of stdout):
{"decode_step_ms": x, "mask_ms": {"1": x, "8": x}, "mask_vs_step": {...}, "one_off_ms": {...}}
The mask time covers the bitmask fill of every constrained row, its unpacking on the logits'
device and the masked fill: the whole sampler stage, measured over a real JSON output.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from engine import LLM, SamplingParams
from engine.grammar import grammar_of
from engine.sampling_params import StructuredOutput
from engine.structured_output import Grammars, apply_grammar_masks

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer"},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 3},
    },
    "required": ["name", "age", "tags"],
}
OUTPUT = '{"name": "Ada Lovelace", "age": 36, "tags": ["math", "poetry", "engines"]}'


class _Row:
    """What the mask stage reads of a request."""

    def __init__(self, matcher) -> None:
        self.matcher = matcher


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    llm = LLM("smollm2-135m")
    tokenizer, vocab = llm.tokenizer, llm.engine.model_config.vocab_size
    constraint = StructuredOutput("json_schema", json.dumps(SCHEMA))
    one_off = _one_off_ms(tokenizer, vocab, constraint)
    step_ms = _decode_step_ms(llm, max(args.batches))
    grammars = Grammars(tokenizer, vocab)
    tokens = tokenizer.encode(OUTPUT, add_special_tokens=False)
    mask_ms = {str(b): _mask_ms(grammars, constraint, tokens, b, vocab) for b in args.batches}
    print(f"decode step at batch {max(args.batches)}: {step_ms:.2f} ms")
    for b, ms in mask_ms.items():
        print(f"mask stage, {b} constrained rows: {ms:.3f} ms ({ms / step_ms:.1%} of the step)")
    for name, ms in one_off.items():
        print(f"{name}: {ms:.1f} ms")
    summary = {
        "decode_step_ms": round(step_ms, 3),
        "decode_batch": max(args.batches),
        "mask_ms": {b: round(ms, 4) for b, ms in mask_ms.items()},
        "mask_vs_step": {b: round(ms / step_ms, 4) for b, ms in mask_ms.items()},
        "one_off_ms": {name: round(ms, 2) for name, ms in one_off.items()},
    }
    print(json.dumps(summary), flush=True)


def _one_off_ms(tokenizer, vocab: int, constraint: StructuredOutput) -> dict[str, float]:
    start = time.perf_counter()
    grammars = Grammars(tokenizer, vocab)
    grammars._vocabulary()  # built on a worker's first constrained request
    vocabulary_ms = (time.perf_counter() - start) * 1e3
    start = time.perf_counter()
    grammar_of(constraint)  # the router's check (then cached)
    grammar_ms = (time.perf_counter() - start) * 1e3
    start = time.perf_counter()
    grammars.matcher(constraint)
    matcher_ms = (time.perf_counter() - start) * 1e3
    return {"vocabulary": vocabulary_ms, "grammar_check": grammar_ms, "matcher": matcher_ms}


def _decode_step_ms(llm: LLM, batch: int, num_tokens: int = 24) -> float:
    """One unconstrained decode step at this batch, from the time of two runs that differ only
    in their number of decode steps (prefill and start-up cancel out)."""
    prompt = "Write a story about a robot."

    def run_s(max_tokens: int) -> float:
        params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
        start = time.perf_counter()
        llm.generate([prompt] * batch, [params] * batch)
        return time.perf_counter() - start

    run_s(2)  # warm-up
    short = statistics.median(run_s(2) for _ in range(3))
    long = statistics.median(run_s(2 + num_tokens) for _ in range(3))
    return (long - short) / num_tokens * 1e3


def _mask_ms(grammars: Grammars, constraint, tokens: list[int], batch: int, vocab: int) -> float:
    rows = [_Row(grammars.matcher(constraint)) for _ in range(batch)]
    logits = torch.zeros(batch, vocab)
    times = []
    for token in tokens:
        start = time.perf_counter()
        apply_grammar_masks(logits, rows)  # type: ignore[arg-type]
        times.append(time.perf_counter() - start)
        for row in rows:
            assert row.matcher.consume_token(token), row.matcher.get_error()
    return statistics.median(times) * 1e3


if __name__ == "__main__":
    main()
