"""The sampler: greedy, temperature, top-k, top-p, per-request seeds."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.sampling_params import SamplingParams


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
