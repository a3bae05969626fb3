"""One planning decision with everything it was made from, for the log and the metrics."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from planner.settings import PoolName

Load = dict[str, float]  # request_rate (req/s), prompt_tokens, output_tokens (means)


@dataclass(frozen=True, slots=True)
class Decision:
    time_s: float
    predictor: str
    observed: Load  # the last interval
    predicted: Load  # the next one
    ttft_s: float | None  # observed means (None: no request in the interval)
    itl_s: float | None
    expected_ttft_s: float | None  # the profile's, at the observed load
    expected_itl_s: float | None
    corrections: dict[PoolName, float]  # observed / expected, as used
    formula: dict[PoolName, int]  # what the formulas ask for, before any limit
    desired: dict[PoolName, int]  # after bounds, cooldowns and the GPU budget
    actual: dict[PoolName, int]  # before this decision
    limited_by: tuple[str, ...]  # which limits changed the formula's counts
    slo_attainment: float | None
    queued_prompt_tokens: float = 0.0  # observed at the interval's end
    backlog_tokens: float = 0.0  # of those, beyond what the pool prefills within the target

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True, slots=True)
class BacklogScaleUp:
    """A prefill scale-up between decisions: the backlog past the TTFT target's worth, and the
    count sized from the prompt tokens/s arriving and that backlog."""

    time_s: float
    queued_prompt_tokens: float
    backlog_tokens: float
    arriving_tokens_per_s: float
    prompt_tokens: float  # the mean length the speed was read at (the last interval's)
    formula: int  # prefill workers, before the limits
    desired: dict[PoolName, int]  # after bounds and the GPU budget (decode kept as it is)
    actual: dict[PoolName, int]
    limited_by: tuple[str, ...]

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)
