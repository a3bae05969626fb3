"""How close an engine variant stays to a reference engine, measured one way for the study
and the tests: the prompts, the fp32 engine's greedy continuations and top-2 margins, the
teacher-forced argmax (the variant's choice at each position given the reference's own
prefix) and where two free-running continuations part.

bench/quant_quality.py reports these for weights and KV rounded several ways;
tests/engine/test_quantization.py asserts on them for the engine's int8 and int4.

Teacher forcing runs prompt chunks, and a quantized engine's chunks read float weights where
its decode steps run the C++ codes kernels: codes_kernels_on_every_step measures the latter."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from engine import quantization
from engine.llm import LLM
from engine.sampling_params import SamplingParams

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
TOP_LOGPROBS = 8


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
    return [o.token_ids[0] for o in _teacher_forced_outputs(llm, prompts, reference, 0)]


def teacher_forced_top(
    llm: LLM, prompts: list[list[int]], reference: list[list[int]]
) -> tuple[list[int], list[dict[int, float]]]:
    """teacher_forced, and at each position the engine's top TOP_LOGPROBS log-probabilities."""
    outputs = _teacher_forced_outputs(llm, prompts, reference, TOP_LOGPROBS)
    return [o.token_ids[0] for o in outputs], [dict(o.logprobs[0].top) for o in outputs]


def _teacher_forced_outputs(llm, prompts, reference, logprobs: int):
    prefixes = [
        p + ref[:i] for p, ref in zip(prompts, reference, strict=True) for i in range(len(ref))
    ]
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, logprobs=logprobs)
    llm.engine.pool.reset_cache()
    return llm.generate(prefixes, one)


def first_divergences(reference: list[list[int]], other: list[list[int]]) -> list[int | None]:
    """Per prompt, the first position where two free-running continuations part (None: never)."""
    return [
        next((i for i, (a, b) in enumerate(zip(r, o, strict=True)) if a != b), None)
        for r, o in zip(reference, other, strict=True)
    ]


@contextmanager
def codes_kernels_on_every_step() -> Iterator[None]:
    """The C++ codes kernels (int4 layers, the Q8_0 head) on steps of any size, prompt chunks
    included, where the engine runs them on decode steps only. A kernel computes each row the
    same way whatever the batch, so teacher-forced positions then see what a decode step
    computes: the weights' codes and the kernels' rounded activations."""
    with quantization.codes_max_rows(1 << 30):
        yield
