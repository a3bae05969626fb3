"""Sampling parameters and the sampler: greedy, temperature, top-k, top-p, per-request seeds."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from engine.errors import InvalidRequestError


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """What to generate. temperature 0 means greedy; a seed makes sampling reproducible."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None
    seed: int | None = None
    stop: Sequence[str] = field(default=())
    stop_token_ids: Sequence[int] = field(default=())
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False  # vLLM's: keep the matched stop string in the text

    def __post_init__(self) -> None:
        # Accept a single stop string or any sequence, the way OpenAI clients send it.
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        object.__setattr__(self, "stop", stop)
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        if self.max_tokens <= 0:
            raise InvalidRequestError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if not math.isfinite(self.temperature) or not math.isfinite(self.top_p):
            raise InvalidRequestError(
                f"temperature and top_p must be finite, got {self.temperature}, {self.top_p}"
            )
        if self.temperature < 0.0:
            raise InvalidRequestError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k is not None and self.top_k < 1:
            raise InvalidRequestError(f"top_k must be at least 1 (or unset), got {self.top_k}")
        if any(not s for s in stop):
            raise InvalidRequestError("stop strings must not be empty")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0


def make_generator(params: SamplingParams, device: str) -> torch.Generator | None:
    """One generator per request, so a seeded request samples the same tokens in any batch."""
    if params.is_greedy:
        return None
    generator = torch.Generator(device=device)
    if params.seed is None:
        generator.seed()
    else:
        generator.manual_seed(params.seed)
    return generator


def sample(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
) -> list[int]:
    """logits: [n, vocab] float32, one row per request that needs a next token. Every row is
    sampled on the logits' device; the tokens come to the host once, in one copy at the end
    (on CUDA, the step's only host sync)."""
    token_ids = logits.argmax(dim=-1)
    for row, (p, generator) in enumerate(zip(params, generators, strict=True)):
        if not p.is_greedy:
            token_ids[row] = _sample_row(logits[row], p, generator)
    return token_ids.tolist()


def _sample_row(
    logits: torch.Tensor, p: SamplingParams, generator: torch.Generator
) -> torch.Tensor:  # 0-d, on the logits' device
    logits = logits / p.temperature
    if p.top_k is not None and p.top_k < logits.numel():
        kth = torch.topk(logits, p.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if p.top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        # Keep the smallest prefix whose mass reaches top_p (always at least one token).
        drop = sorted_probs.cumsum(0) - sorted_probs >= p.top_p
        sorted_probs.masked_fill_(drop, 0.0)  # not probs[mask] = 0: that syncs on CUDA
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
    return torch.multinomial(probs, 1, generator=generator)[0]
