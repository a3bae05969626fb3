"""The sampler's time per decode step at batch 1 and 32, per sampling mode, on the real model's
logits, against the forward pass of the same step measured in the same run.

    python -m bench.sampler [--threads 2] [--repeats 20]

Prints a table, then a JSON summary as the last line: sampler ms per step per mode and batch,
and each as a fraction of the step's forward pass."""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from dataclasses import replace

import torch

from engine import LLM, SamplingParams
from engine import model_runner as runner_module
from engine.request import Request
from engine.sampling import make_generator, sample

BATCHES = (1, 32)
NUM_DECODE_TOKENS = 24  # the logits come from the last decode step: outputs to penalize
MODES = {
    "greedy": SamplingParams(temperature=0.0),
    "temperature": SamplingParams(temperature=0.8, seed=1),
    "top_k_top_p": SamplingParams(temperature=0.8, top_k=50, top_p=0.95, seed=1),
    "top_p": SamplingParams(temperature=0.8, top_p=0.9, seed=1),
    "penalties": SamplingParams(
        temperature=0.0, presence_penalty=0.5, frequency_penalty=0.5, repetition_penalty=1.1
    ),
    "everything": SamplingParams(
        temperature=0.8,
        top_k=50,
        top_p=0.95,
        min_p=0.05,
        seed=1,
        presence_penalty=0.5,
        frequency_penalty=0.5,
        repetition_penalty=1.1,
        min_tokens=64,
        logit_bias={42: 1.0},
        max_tokens=64,
    ),  # fmt: skip
}


def capture_last_step(llm: LLM, batch: int) -> tuple[torch.Tensor, list[Request], float]:
    """Runs `batch` prompts; returns the logits and requests of the last decode step with all
    of them (prompts admitted in different steps end in different steps), and the median
    forward time of the decode steps (s)."""
    captured: list[tuple[torch.Tensor, list[Request]]] = []
    forward_s: list[float] = []
    runner = llm.engine.runner
    forward = runner.forward

    def timed_forward(scheduled):  # noqa: ANN001, ANN202
        start = time.perf_counter()
        result = forward(scheduled)
        if all(item.num_new_tokens == 1 for item in scheduled):
            forward_s.append(time.perf_counter() - start)
        return result

    def capturing_sample(logits: torch.Tensor, requests: list[Request]) -> list[int]:
        captured.append((logits.clone(), [replace(r) for r in requests]))
        return sample(logits, requests)

    runner.forward = timed_forward
    runner_module.sample = capturing_sample
    try:
        prompts = [f"Story {i}: once upon a time, in a town by the sea," for i in range(batch)]
        params = SamplingParams(max_tokens=NUM_DECODE_TOKENS, temperature=0.0, ignore_eos=True)
        llm.generate(prompts, params)
    finally:
        runner.forward = forward
        runner_module.sample = sample
    logits, requests = [step for step in captured if len(step[1]) == batch][-1]
    return logits, requests, statistics.median(forward_s)


def time_mode(logits: torch.Tensor, requests: list[Request], params: SamplingParams,
              repeats: int) -> float:  # fmt: skip
    rows = [replace(r, params=params, generator=make_generator(params, "cpu")) for r in requests]
    run: Callable[[], object] = lambda: sample(logits.clone(), rows)  # noqa: E731
    run()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    llm = LLM(num_threads=args.threads, num_blocks=512)
    summary: dict[str, dict] = {"sampler_ms": {}, "fraction_of_forward": {}, "forward_ms": {}}
    for batch in BATCHES:
        logits, requests, forward_s = capture_last_step(llm, batch)
        summary["forward_ms"][str(batch)] = round(forward_s * 1e3, 2)
        for mode, params in MODES.items():
            seconds = time_mode(logits, requests, params, args.repeats)
            summary["sampler_ms"].setdefault(mode, {})[str(batch)] = round(seconds * 1e3, 3)
            summary["fraction_of_forward"].setdefault(mode, {})[str(batch)] = round(
                seconds / forward_s, 4
            )
            share = seconds / forward_s
            print(f"batch {batch:3d}  {mode:12s} {seconds * 1e3:8.3f} ms  ({share:.1%} of the "
                  f"{forward_s * 1e3:.1f} ms forward)")  # fmt: skip
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
