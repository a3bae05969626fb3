"""One-step-ahead forecasts of a load series (request rate, mean prompt and output length):
the next interval's value from the ones observed so far."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from planner.settings import PlannerSettings, PredictorName


class Predictor(Protocol):
    def observe(self, value: float) -> None: ...

    def predict(self) -> float:
        """The next interval's value; 0 before the first observation."""
        ...


@dataclass(slots=True)
class Constant:
    """Next = last: reacts one interval late, never overshoots."""

    last: float = 0.0

    def observe(self, value: float) -> None:
        self.last = value

    def predict(self) -> float:
        return self.last


@dataclass(slots=True)
class Ewma:
    """Exponentially weighted mean: smooths noise, lags a trend by about (1 - alpha) / alpha
    intervals."""

    alpha: float
    level: float | None = None

    def observe(self, value: float) -> None:
        self.level = value if self.level is None else (
            self.alpha * value + (1 - self.alpha) * self.level
        )  # fmt: skip

    def predict(self) -> float:
        return 0.0 if self.level is None else self.level


@dataclass(slots=True)
class Holt:
    """Holt's linear trend: a smoothed level plus a smoothed per-interval slope, so a rising
    load is met one interval ahead rather than one behind. Never predicts below 0."""

    alpha: float
    beta: float
    level: float | None = None
    trend: float = 0.0

    def observe(self, value: float) -> None:
        if self.level is None:
            self.level = value
            return
        previous = self.level
        self.level = self.alpha * value + (1 - self.alpha) * (previous + self.trend)
        self.trend = self.beta * (self.level - previous) + (1 - self.beta) * self.trend

    def predict(self) -> float:
        return 0.0 if self.level is None else max(0.0, self.level + self.trend)


def make_predictor(name: PredictorName, settings: PlannerSettings) -> Predictor:
    if name == "constant":
        return Constant()
    if name == "ewma":
        return Ewma(settings.ewma_alpha)
    return Holt(settings.holt_alpha, settings.holt_beta)
