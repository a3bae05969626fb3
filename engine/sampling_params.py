"""What to generate: a request's sampling parameters, validated. Torch-free, so the router
validates requests without loading torch."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

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
