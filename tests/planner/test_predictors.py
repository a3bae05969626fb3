"""The forecasts, value by value (every number here is exact in binary floating point)."""

from __future__ import annotations

from planner.predictors import Constant, Ewma, Holt, make_predictor
from planner.settings import PlannerSettings


def forecasts(predictor, values: list[float]) -> list[float]:
    out = []
    for value in values:
        predictor.observe(value)
        out.append(predictor.predict())
    return out


def test_nothing_observed_predicts_zero():
    assert [p.predict() for p in (Constant(), Ewma(0.5), Holt(0.5, 0.5))] == [0.0, 0.0, 0.0]


def test_constant_repeats_the_last_value():
    assert forecasts(Constant(), [10, 20, 5]) == [10, 20, 5]


def test_ewma_weighs_the_newest_by_alpha():
    assert forecasts(Ewma(0.5), [10, 20, 30]) == [10, 15, 22.5]
    assert forecasts(Ewma(0.25), [8, 16]) == [8, 10]


def test_holt_follows_a_trend_ahead_of_the_level():
    # level 10 -> 15 -> 23.75, trend 0 -> 2.5 -> 5.625: the forecast adds the trend
    assert forecasts(Holt(0.5, 0.5), [10, 20, 30]) == [10, 17.5, 29.375]


def test_holt_never_predicts_below_zero():
    # level 10, 5, 1.25; trend 0, -2.5, -3.125: 1.25 - 3.125 < 0
    assert forecasts(Holt(0.5, 0.5), [10, 0, 0]) == [10, 2.5, 0.0]


def test_make_predictor_takes_the_settings_parameters():
    settings = PlannerSettings(ewma_alpha=0.25, holt_alpha=0.5, holt_beta=0.25)
    assert make_predictor("constant", settings) == Constant()
    assert make_predictor("ewma", settings) == Ewma(0.25)
    assert make_predictor("holt", settings) == Holt(0.5, 0.25)
