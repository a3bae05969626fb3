"""How far the router's predicted time to first token is from what requests then see, per pool.

The prediction counts prompt tokens in front of a request at the prefill speed; what a
request sees also holds the KV transfer, the decode worker's first step and the cores a
aggregated decode batch takes from prefill, none of which the prediction models. So the
router learns one factor per pool, observed / predicted, and multiplies its predictions by it
before it sheds by them. The factor is a ratio of smoothed sums, not a mean of ratios: a long
wait weighs more than a short one, which is what the shedding decision is about.

That corrected prediction is a point estimate: about half the requests admitted just under the
objective see more. Under a sustained overload that is where every admitted request is (the
queue fills until new arrivals are predicted at the objective), so shedding by it bounds their
median, not their tail. So each correction also keeps the recent observed / modelled ratios,
and admission sheds by the prediction times the tail margin: how far their 99th percentile is
above the factor (never below 1, so the margin only ever sheds more).
"""

from __future__ import annotations

from bisect import bisect_left, insort
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

SMOOTHING = 0.1  # weight of the newest sample in both sums
# Bounds on the factor: a burst of odd samples cannot make the router shed everything or nothing.
MIN_FACTOR, MAX_FACTOR = 0.25, 4.0
# The tail margin: the 99th percentile of this many recent ratios (the fewest that define one),
# once there are TAIL_MIN_SAMPLES; within [1, MAX_FACTOR / MIN_FACTOR].
TAIL_QUANTILE, TAIL_WINDOW, TAIL_MIN_SAMPLES = 99, 100, 10


@dataclass(slots=True)
class TTFTCorrection:
    """observed / predicted TTFT, smoothed; 1.0 until a prediction long enough to judge ends."""

    min_predicted_s: float
    observed_s: float = 0.0
    predicted_s: float = 0.0
    ratios: deque[float] = field(default_factory=lambda: deque(maxlen=TAIL_WINDOW))
    # The same ratios in order: the tail margin is read at every first token, and a window
    # kept sorted costs one insertion and one removal per sample, not a sort per read.
    _sorted: list[float] = field(default_factory=list)

    def observe(self, predicted_s: float, observed_s: float) -> None:
        if predicted_s < self.min_predicted_s:
            return
        ratio = observed_s / predicted_s
        if len(self.ratios) == self.ratios.maxlen:
            del self._sorted[bisect_left(self._sorted, self.ratios[0])]
        self.ratios.append(ratio)
        insort(self._sorted, ratio)
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

    @property
    def tail_margin(self) -> float:
        """The recent ratios' 99th percentile over the factor; 1.0 until there are enough."""
        if len(self.ratios) < TAIL_MIN_SAMPLES:
            return 1.0
        tail = percentile(self._sorted, TAIL_QUANTILE)
        return min(MAX_FACTOR / MIN_FACTOR, max(1.0, tail / self.factor))


def percentile(data: Sequence[float], q: int) -> float:
    """statistics.quantiles(data, n=100, method="inclusive")[q - 1] of sorted data, to the
    last bit, without the 98 other cut points it computes (it ran on every first token)."""
    j, delta = divmod(q * (len(data) - 1), 100)
    return (data[j] * (100 - delta) + data[min(j + 1, len(data) - 1)] * delta) / 100


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

    def tail_margin(self, kind: str) -> float:
        correction = self._by_kind.get(kind)
        return 1.0 if correction is None else correction.tail_margin
