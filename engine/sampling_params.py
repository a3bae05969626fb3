"""What to generate: a request's sampling parameters, validated. Torch-free, so the router
validates requests without loading torch."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Literal

from engine.errors import InvalidRequestError

MAX_ABS_PENALTY = 2.0  # presence and frequency penalties, as in OpenAI's API and vLLM
MAX_ABS_LOGIT_BIAS = 100.0  # OpenAI's range for logit_bias values
MAX_LOGPROBS = 20  # alternatives per token, OpenAI's limit
MAX_N = 16  # samples per request: each is a sequence in the batch, all admitted at once

GrammarKind = Literal["json_schema", "json_object", "regex", "choice", "grammar"]


@dataclass(frozen=True, slots=True)
class StructuredOutput:
    """A constraint on the whole output (engine/grammar.py turns it into a grammar). spec:
    json_schema: the schema, serialized; regex: the pattern; choice: a JSON list of strings;
    grammar: Lark or GBNF; json_object: ""."""

    kind: GrammarKind
    spec: str = ""


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """What to generate. temperature 0 means greedy; a seed makes sampling reproducible.

    Penalties, min_p, min_tokens and logit_bias mean what they mean in vLLM (docs/engine.md,
    "The sampler")."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None
    min_p: float = 0.0  # drop tokens below min_p x the most likely token's probability
    seed: int | None = None
    presence_penalty: float = 0.0  # subtracted once from every token already generated
    frequency_penalty: float = 0.0  # subtracted once per time a token was generated
    repetition_penalty: float = 1.0  # divides (positive) / multiplies logits of seen tokens
    min_tokens: int = 0  # EOS, stop token ids and stop strings cannot end it sooner
    logit_bias: Mapping[int, float] = field(default_factory=dict)  # token id -> added to logit
    # With a number k: each output token's logprob and the k most likely alternatives, raw (the
    # model's log-softmax, before any option above changes the logits, as vLLM's default).
    logprobs: int | None = None
    # Samples of the prompt: sample 0 is the request itself; once its prompt is computed, the
    # engine forks samples 1..n-1 (engine/llm_engine.py), which find the prompt's KV in the
    # prefix cache, each with its own RNG stream (seed + i when seeded).
    n: int = 1
    stop: Sequence[str] = field(default=())
    stop_token_ids: Sequence[int] = field(default=())
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False  # vLLM's: keep the matched stop string in the text
    structured_output: StructuredOutput | None = None

    def __post_init__(self) -> None:
        # Accept a single stop string or any sequence, the way OpenAI clients send it.
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        object.__setattr__(self, "stop", stop)
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        object.__setattr__(self, "logit_bias", _logit_bias(self.logit_bias))
        if self.max_tokens <= 0:
            raise InvalidRequestError(f"max_tokens must be at least 1, got {self.max_tokens}")
        self._check_finite()
        if self.temperature < 0.0:
            raise InvalidRequestError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k is not None and self.top_k < 1:
            raise InvalidRequestError(f"top_k must be at least 1 (or unset), got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            raise InvalidRequestError(f"min_p must be in [0, 1], got {self.min_p}")
        if any(not s for s in stop):
            raise InvalidRequestError("stop strings must not be empty")
        self._check_penalties()
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise InvalidRequestError(
                f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}"
            )
        self._check_logit_bias()
        if not 1 <= self.n <= MAX_N:
            raise InvalidRequestError(f"n must be in [1, {MAX_N}], got {self.n}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise InvalidRequestError(
                f"logprobs must be in [0, {MAX_LOGPROBS}] (or unset), got {self.logprobs}"
            )

    def _check_finite(self) -> None:
        names = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                 "repetition_penalty")  # fmt: skip
        for name in names:
            if not math.isfinite(getattr(self, name)):
                raise InvalidRequestError(f"{name} must be finite, got {getattr(self, name)}")

    def _check_penalties(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            if abs(getattr(self, name)) > MAX_ABS_PENALTY:
                raise InvalidRequestError(
                    f"{name} must be in [-{MAX_ABS_PENALTY:g}, {MAX_ABS_PENALTY:g}], got "
                    f"{getattr(self, name)}"
                )
        if self.repetition_penalty <= 0.0:
            raise InvalidRequestError(
                f"repetition_penalty must be > 0, got {self.repetition_penalty}"
            )

    def _check_logit_bias(self) -> None:
        for token_id, bias in self.logit_bias.items():
            if token_id < 0:
                raise InvalidRequestError(f"logit_bias token id {token_id} is negative")
            if not (math.isfinite(bias) and abs(bias) <= MAX_ABS_LOGIT_BIAS):
                raise InvalidRequestError(
                    f"logit_bias for token {token_id} must be in [-{MAX_ABS_LOGIT_BIAS:g}, "
                    f"{MAX_ABS_LOGIT_BIAS:g}], got {bias}"
                )

    def sample(self, index: int) -> SamplingParams:
        """Sample index's own parameters: one sample, seeded seed + index (mod 2**64, a
        proto uint64) when the request is seeded."""
        seed = None if self.seed is None else (self.seed + index) % (1 << 64)
        return replace(self, n=1, seed=seed)

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )


def _logit_bias(bias: Mapping[int, float]) -> dict[int, float]:
    """JSON object keys are strings: "50256" is token 50256."""
    try:
        return {int(token_id): float(value) for token_id, value in bias.items()}
    except (TypeError, ValueError, AttributeError) as e:
        raise InvalidRequestError(f"logit_bias must map token ids to numbers: {e}") from e
