"""How far the router's predicted time to first token is from what requests then see, per pool.

The prediction counts prompt tokens in front of a request at the prefill speed; what a
request sees also holds the KV transfer, the decode worker's first step and the cores a
colocated decode batch takes from prefill, none of which the prediction models. So the
router learns one factor per pool, observed / predicted, and multiplies its predictions by it
before it sheds by them. The factor is a ratio of smoothed sums, not a mean of ratios: a long
wait weighs more than a short one, which is what the shedding decision is about.
"""

from __future__ import annotations

from dataclasses import dataclass, field

SMOOTHING = 0.1  # weight of the newest sample in both sums
# Bounds on the factor: a burst of odd samples cannot make the router shed everything or nothing.
MIN_FACTOR, MAX_FACTOR = 0.25, 4.0


@dataclass(slots=True)
class TTFTCorrection:
    """observed / predicted TTFT, smoothed; 1.0 until a prediction long enough to judge ends."""

    min_predicted_s: float
    observed_s: float = 0.0
    predicted_s: float = 0.0

    def observe(self, predicted_s: float, observed_s: float) -> None:
        if predicted_s < self.min_predicted_s:
            return
        if self.predicted_s == 0.0:
            self.observed_s, self.predicted_s = observed_s, predicted_s
            return
        keep = 1.0 - SMOOTHING
        self.observed_s = keep * self.observed_s + SMOOTHING * observed_s
        self.predicted_s = keep * self.predicted_s + SMOOTHING * predicted_s

    @property
    def factor(self) -> float:
        if self.predicted_s == 0.0:
            return 1.0
        return min(MAX_FACTOR, max(MIN_FACTOR, self.observed_s / self.predicted_s))


@dataclass(slots=True)
class TTFTCorrections:
    """One correction per pool kind ("aggregated" or "split"). Predictions shorter than
    min_predicted_s are mostly the fixed costs the model leaves out (the first decode step,
    the first message): they say little about queueing, where shedding decisions are made, so
    only those near the objective (admission passes half of it) are learned from."""

    min_predicted_s: float
    _by_kind: dict[str, TTFTCorrection] = field(default_factory=dict)

    def observe(self, kind: str, predicted_s: float, observed_s: float) -> None:
        correction = self._by_kind.setdefault(kind, TTFTCorrection(self.min_predicted_s))
        correction.observe(predicted_s, observed_s)

    def factor(self, kind: str) -> float:
        correction = self._by_kind.get(kind)
        return 1.0 if correction is None else correction.factor
