"""What one worker of each pool can do, measured ahead of time: prefill seconds per prompt
length, and decode step seconds (the inter-token latency) per batch size and context length.
The planner turns load into replicas with these; a cluster's profile comes from timing its
own workers, the simulator's from its cost model."""

from __future__ import annotations

import bisect
import json
from dataclasses import asdict, dataclass
from pathlib import Path


class ProfileError(ValueError):
    """A profile that cannot be interpolated (empty, unsorted, or non-positive times)."""


def _interpolate(xs: tuple[float, ...], ys: tuple[float, ...], x: float) -> float:
    """Piecewise linear through the points; the end segments extend past the ends, since cost
    keeps growing with length and batch beyond the longest point timed."""
    if len(xs) == 1:
        return ys[0] * x / xs[0] if xs[0] else ys[0]
    i = min(max(bisect.bisect_left(xs, x), 1), len(xs) - 1)
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


def _check_axis(name: str, values: tuple[float, ...]) -> None:
    if not values or any(b <= a for a, b in zip(values, values[1:], strict=False)):
        raise ProfileError(f"{name} must be non-empty and strictly increasing: {values}")


@dataclass(frozen=True, slots=True)
class PrefillProfile:
    """prefill_s[i]: one prompt of prompt_tokens[i] tokens alone on an idle worker."""

    prompt_tokens: tuple[int, ...]
    prefill_s: tuple[float, ...]

    def __post_init__(self) -> None:
        _check_axis("prompt_tokens", self.prompt_tokens)
        if len(self.prefill_s) != len(self.prompt_tokens) or min(self.prefill_s) <= 0:
            raise ProfileError(f"prefill_s must be one positive time per length: {self.prefill_s}")

    def ttft_s(self, prompt_tokens: float) -> float:
        """The TTFT of a prompt with no queue in front of it."""
        return _interpolate(self.prompt_tokens, self.prefill_s, prompt_tokens)

    def tokens_per_s(self, prompt_tokens: float) -> float:
        """One worker's prompt tokens per second when busy with prompts of this length."""
        return prompt_tokens / self.ttft_s(prompt_tokens)


@dataclass(frozen=True, slots=True)
class DecodeProfile:
    """itl_s[c][b]: one decode step's seconds with batch_sizes[b] requests, each holding
    context_tokens[c] tokens of KV."""

    context_tokens: tuple[int, ...]
    batch_sizes: tuple[int, ...]
    itl_s: tuple[tuple[float, ...], ...]

    def __post_init__(self) -> None:
        _check_axis("context_tokens", self.context_tokens)
        _check_axis("batch_sizes", self.batch_sizes)
        shape_ok = len(self.itl_s) == len(self.context_tokens) and all(
            len(row) == len(self.batch_sizes) and min(row) > 0 for row in self.itl_s
        )
        if not shape_ok:
            raise ProfileError("itl_s must be a positive time per (context, batch size)")

    def _row(self, context_tokens: float) -> tuple[float, ...]:
        """The timed context at or above this one (the longest if none is): conservative."""
        i = min(bisect.bisect_left(self.context_tokens, context_tokens),
                len(self.context_tokens) - 1)  # fmt: skip
        return self.itl_s[i]

    def itl(self, batch_size: float, context_tokens: float) -> float:
        return _interpolate(self.batch_sizes, self._row(context_tokens), max(1.0, batch_size))

    def best_tokens_per_s(self, itl_target_s: float, context_tokens: float) -> float:
        """The most output tokens per second one worker makes with every step within the
        target: the largest timed batch that meets it. If even batch 1 misses it, batch 1's
        rate (nothing does better)."""
        row = self._row(context_tokens)
        meeting = [b / s for b, s in zip(self.batch_sizes, row, strict=True) if s <= itl_target_s]
        return max(meeting) if meeting else self.batch_sizes[0] / row[0]


@dataclass(frozen=True, slots=True)
class Profile:
    prefill: PrefillProfile
    decode: DecodeProfile

    @classmethod
    def load(cls, path: Path) -> Profile:
        data = json.loads(path.read_text())
        decode = data["decode"]
        return cls(
            PrefillProfile(tuple(data["prefill"]["prompt_tokens"]),
                           tuple(data["prefill"]["prefill_s"])),
            DecodeProfile(tuple(decode["context_tokens"]), tuple(decode["batch_sizes"]),
                          tuple(tuple(row) for row in decode["itl_s"])),
        )  # fmt: skip

    def save(self, path: Path) -> None:
        path.write_text(json.dumps(asdict(self), indent=1) + "\n")
