"""Fits the local cost model: times the real engine's steps on this machine (one torch thread,
as each worker of a 2-core `pdserve up` gets) and least-squares the step time on its shape.

Usage: python -m sim.calibrate [--threads 1] [--out sim/local_cpu.json]   (~1-2 minutes)
The last line printed is the JSON written.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import time
from contextlib import contextmanager
from dataclasses import asdict, fields
from pathlib import Path

import numpy as np

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.config import ModelConfig
from engine.model_files import resolve_model
from sim.costs import (
    FITTED_QUANTIZATION,
    LOCAL_COEFFICIENTS,
    LocalCoefficients,
    StepShape,
    kv_bytes_per_token,
)

FEATURES = ("overhead_s", "per_prefill_token_s", "per_attention_pair_s", "per_decode_s",
            "per_decode_context_s", "per_small_step_s")  # fmt: skip
PREFILL_LENGTHS = (32, 128, 384, 1000)  # 1000 runs as 512 + 488 after 512 cached
DECODE_BATCHES = ((1, 32), (4, 32), (16, 32), (32, 32), (8, 480))  # (batch, prompt tokens)
DECODE_NEW_TOKENS = 8
ROUNDS = 3  # the first is a warm-up and is not used


def features(shape: StepShape) -> list[float]:
    return [1.0, shape.num_prefill_tokens, shape.num_attention_pairs, shape.num_decode,
            shape.decode_context, float(shape.is_small)]  # fmt: skip


def _engine(threads: int) -> LLMEngine:
    return LLMEngine(EngineConfig(num_threads=threads, chunk_size=512, num_blocks=512,
                                  enable_prefix_caching=False,
                                  quantization=FITTED_QUANTIZATION))  # fmt: skip


def measure(threads: int) -> list[tuple[StepShape, float]]:
    engine = _engine(threads)
    runner = engine.runner
    execute = runner.execute
    shapes: list[StepShape] = []

    def recording_execute(batch):
        shapes.append(StepShape.of(batch))
        return execute(batch)

    runner.execute = recording_execute  # the step itself stays the real one
    rng = np.random.default_rng(0)
    samples: dict[StepShape, list[float]] = {}
    for round_index in range(ROUNDS):
        for n in PREFILL_LENGTHS:
            _run(engine, [rng.integers(100, 40000, n).tolist()], 1, f"p{round_index}-{n}",
                 shapes, samples, round_index)  # fmt: skip
        for batch, length in DECODE_BATCHES:
            prompts = rng.integers(100, 40000, (batch, length)).tolist()
            _run(engine, prompts, DECODE_NEW_TOKENS, f"d{round_index}-{batch}-{length}",
                 shapes, samples, round_index)  # fmt: skip
    return [(shape, statistics.median(times)) for shape, times in samples.items()]


def _run(engine, prompts, max_tokens, tag, shapes, samples, round_index) -> None:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", prompt, params)
    while engine.has_unfinished_requests():
        started = time.perf_counter()
        engine.step()
        seconds = time.perf_counter() - started
        if round_index > 0:  # round 0 pays first-run costs
            samples.setdefault(shapes[-1], []).append(seconds)


def fit(points: list[tuple[StepShape, float]]) -> tuple[dict[str, float], float]:
    """Least squares with every coefficient >= 0: a feature that fits negative is dropped.
    Returns the coefficients and the mean absolute relative error over the points."""
    x = np.array([features(s) for s, _ in points])
    y = np.array([t for _, t in points])
    active = list(range(x.shape[1]))
    while True:
        # Relative error matters (a 10 ms decode step and a 2 s prefill alike): weight by 1/y.
        w = 1.0 / y
        coef, *_ = np.linalg.lstsq(x[:, active] * w[:, None], y * w, rcond=None)
        if (coef >= 0).all():
            break
        active.pop(int(np.argmin(coef)))
    full = np.zeros(x.shape[1])
    full[active] = coef
    error = float(np.mean(np.abs(x @ full - y) / y))
    return dict(zip(FEATURES, full.tolist(), strict=True)), error


@contextmanager
def neighbour(cores: list[int], threads: int):
    """Another engine stepping on those cores meanwhile (the same steps, over and over), as a
    worker beside the one timed would: they share memory bandwidth and caches."""
    context = multiprocessing.get_context("spawn")
    ready, stop = context.Event(), context.Event()
    process = context.Process(target=_step_forever, args=(cores, threads, ready, stop))
    process.start()
    try:
        if not ready.wait(timeout=300):
            raise RuntimeError("the neighbour engine did not start")
        yield
    finally:
        stop.set()
        process.join(timeout=60)


def _step_forever(cores: list[int], threads: int, ready, stop) -> None:
    os.sched_setaffinity(0, cores)
    engine = _engine(threads)
    rng = np.random.default_rng(1)
    ready.set()
    params = SamplingParams(max_tokens=DECODE_NEW_TOKENS, temperature=0.0, ignore_eos=True)
    count = 0
    while not stop.is_set():
        length = PREFILL_LENGTHS[count % len(PREFILL_LENGTHS)]
        prompts = [rng.integers(100, 40000, length).tolist()]
        prompts += rng.integers(100, 40000, (4, 32)).tolist()  # and a decode batch
        for prompt in prompts:
            engine.add_request(f"n{count}", prompt, params)
            count += 1
        while engine.has_unfinished_requests() and not stop.is_set():
            engine.step()


def calibrate(threads: int) -> LocalCoefficients:
    """Times the real engine's steps here and fits the cost model to them."""
    started = time.perf_counter()
    points = measure(threads)
    coefficients, error = fit(points)
    model = ModelConfig.from_dir(resolve_model("smollm2-135m"))
    return LocalCoefficients(
        **coefficients, threads=threads,
        model={f.name: getattr(model, f.name) for f in fields(ModelConfig)},
        kv_bytes_per_token=kv_bytes_per_token(model, 4),  # fp32 KV
        fit={"num_points": len(points), "mean_abs_relative_error": round(error, 4),
             "seconds": round(time.perf_counter() - started, 1),
             "points": [[*features(s)[1:], round(t, 5)] for s, t in points]},
    )  # fmt: skip


def summary(result: LocalCoefficients) -> dict:
    """The fit without its points, for a JSON line."""
    return asdict(result) | {"fit": {k: v for k, v in result.fit.items() if k != "points"}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default=str(LOCAL_COEFFICIENTS))
    args = parser.parse_args()
    result = calibrate(args.threads)
    result.save(Path(args.out))
    print(f"{result.fit['num_points']} step shapes, "
          f"mean |error| {result.fit['mean_abs_relative_error']:.1%}")  # fmt: skip
    print(json.dumps(summary(result)))


if __name__ == "__main__":
    main()
