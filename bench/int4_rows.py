"""The int4 engine's decode step by batch size: the C++ codes kernels (the int4 layers and the
Q8_0 head: 0.75 bytes a weight) against oneDNN's float32 matmul of the packed copy (4 bytes a
weight), in one engine, the two paths taking turns.

The engine reads the codes on steps of up to CODES_MAX_ROWS rows and the packed copy on larger
ones (engine/quantization.py). This measures both at every --batches size, so the limit can be
checked on the machine at hand: a decode step reads every weight once, and the codes win until
the step is compute-bound.

Per batch B: B prompts of --prompt-tokens tokens; once every one has its first token, the time of
--steps decode steps (all B decoding), best of --repeats runs per path. The last line of stdout
is JSON: ms per step for each path and batch ("codes", "packed_fp32"), codes / packed, the path
the engine takes at each batch, and "engine_vs_best": the engine's path's time over the faster
path's, per batch and its worst (1.0: the limit sends every batch to the faster path).
Run from the repository root: python -m bench.int4_rows (about two minutes on 2 cores).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from itertools import count

from engine import SamplingParams, quantization
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine

PATHS = {"codes": 1 << 30, "packed_fp32": 0}  # the codes kernels' row limit on each path


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 4, 6, 8, 12, 16, 24, 32])
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--steps", type=int, default=24, help="timed decode steps per run")
    parser.add_argument("--repeats", type=int, default=3, help="runs per path and batch")
    parser.add_argument("--threads", type=int, default=2)
    return parser.parse_args()


def decode_step_ms(engine: LLMEngine, batch: int, args: argparse.Namespace, ids: count) -> float:
    """B requests prefilled (untimed), then the mean of --steps decode steps of all B."""
    params = SamplingParams(max_tokens=args.steps + 2, temperature=0.0, ignore_eos=True)
    prompts = [[100 + i + j for j in range(args.prompt_tokens)] for i in range(batch)]
    requests = [engine.add_request(f"r{next(ids)}", prompt, params) for prompt in prompts]
    while any(r.num_output_tokens == 0 for r in requests):
        engine.step()
    started = time.perf_counter()
    for _ in range(args.steps):
        engine.step()
    elapsed_s = time.perf_counter() - started
    for request in requests:  # the last tokens are not timed
        engine.abort_request(request.request_id)
    return elapsed_s / args.steps * 1e3


def main() -> None:
    args = parse_args()
    engine = LLMEngine(EngineConfig(num_threads=args.threads))
    if engine.config.quantization != "int4":
        sys.exit(f"the engine runs quantization {engine.config.quantization!r} here, not int4: "
                 "the codes kernels need the bundled Q4_1 model in float32 on the CPU")  # fmt: skip
    ids = count()
    decode_step_ms(engine, 2, args, ids)  # first-run costs
    ms: dict[str, dict[str, float]] = {path: {} for path in PATHS}
    for batch in args.batches:
        best = dict.fromkeys(PATHS, float("inf"))
        for repeat in range(args.repeats):
            order = list(PATHS) if repeat % 2 == 0 else list(reversed(PATHS))
            for path in order:
                with quantization.codes_max_rows(PATHS[path]):
                    best[path] = min(best[path], decode_step_ms(engine, batch, args, ids))
        for path in PATHS:
            ms[path][str(batch)] = round(best[path], 2)
        print(f"batch {batch:3d}: codes {best['codes']:6.1f} ms  packed fp32 "
              f"{best['packed_fp32']:6.1f} ms a step", flush=True)  # fmt: skip
    limit = quantization.CODES_MAX_ROWS
    engine_path = {b: "codes" if int(b) <= limit else "packed_fp32" for b in ms["codes"]}
    engine_vs_best = {
        b: round(ms[engine_path[b]][b] / min(ms["codes"][b], ms["packed_fp32"][b]), 3)
        for b in ms["codes"]
    }
    ratios = {b: round(ms["codes"][b] / ms["packed_fp32"][b], 3) for b in ms["codes"]}
    print(json.dumps({
        "ms_per_step": ms, "codes_vs_packed": ratios,
        "codes_max_rows": limit, "engine_path": engine_path, "engine_vs_best": engine_vs_best,
        "engine_vs_best_worst": max(engine_vs_best.values()),
        "setup": {"prompt_tokens": args.prompt_tokens, "steps": args.steps,
                  "repeats": args.repeats, "threads": args.threads},
    }))  # fmt: skip


if __name__ == "__main__":
    main()
