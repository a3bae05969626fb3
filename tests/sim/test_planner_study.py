"""`pdserve sim planner` end to end on a six-minute day: the table, the plot, the JSON line."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from pdserve.cli import app
from sim.planner_study import Day


def test_day_rises_to_its_peak_and_back():
    day = Day()
    assert (day.rate(0.0), day.rate(3600.0)) == (3.0, 24.0)
    short = day.lasting(0.1)
    assert (short.duration_s, short.long_start_s, short.long_s) == (360.0, 240.0, 60.0)
    requests = list(short.requests(0))
    assert requests == list(short.requests(0))  # one seed, one day
    long = [r for r in requests if 240.0 <= r.arrival_s < 300.0]
    assert min(r.prompt_tokens for r in long) > max(r.prompt_tokens for r in requests[:20]) / 4


def test_planner_study_prints_its_json_last(tmp_path):
    result = CliRunner().invoke(app, ["sim", "planner", "--hours", "0.1", "--out", str(tmp_path)])
    assert result.exit_code == 0, result.output
    last = json.loads(result.output.strip().splitlines()[-1])
    assert set(last["predictors"]) == {"constant", "ewma", "holt"}
    assert {"slo_attainment", "gpu_hours_vs_best_static"} <= set(last)
    for row in last["predictors"].values():
        assert 0.0 <= row["slo_attainment"] <= 1.0
        assert row["decisions"] >= 6  # one a minute, until the last request ends
        assert {"gpu_hours", "best_static", "meets_targets", "backlog_scale_ups"} <= set(row)
    assert json.loads((tmp_path / "planner.json").read_text()) == last
    assert (tmp_path / "planner-replicas.png").stat().st_size > 0
