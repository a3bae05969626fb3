"""Prompt length buckets, shared by router admission and every per-bucket metric."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

LengthBucket = Literal["short", "medium", "long"]
LENGTH_BUCKETS: tuple[LengthBucket, ...] = ("short", "medium", "long")


@dataclass(frozen=True, slots=True)
class LengthBuckets:
    short_below: int = 512  # prompts shorter than this are "short"
    long_above: int = 2048  # prompts longer than this are "long"

    def __post_init__(self) -> None:
        if not 0 < self.short_below <= self.long_above:
            raise ValueError(
                f"length buckets need 0 < short_below ({self.short_below}) <= "
                f"long_above ({self.long_above})"
            )

    def of(self, num_tokens: int) -> LengthBucket:
        if num_tokens < self.short_below:
            return "short"
        return "long" if num_tokens > self.long_above else "medium"

    def representatives(self, max_tokens: int) -> list[int]:
        """One prompt length per bucket, for warm-up (clipped to what the worker can hold)."""
        lengths = [self.short_below // 2, (self.short_below + self.long_above) // 2,
                   self.long_above + 256]  # fmt: skip
        return sorted({min(n, max_tokens) for n in lengths})
