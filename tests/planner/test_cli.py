"""`pdserve planner` refuses to start without what the cluster loop needs, naming it."""

from __future__ import annotations

from typer.testing import CliRunner

from pdserve.cli import app

CLUSTER = {
    "PDSERVE_PLANNER_NAMESPACE": "serving",
    "PDSERVE_PLANNER_PREFILL_DEPLOYMENT": "pd-prefill",
    "PDSERVE_PLANNER_DECODE_DEPLOYMENT": "pd-decode",
    "PDSERVE_PLANNER_PROMETHEUS_URL": "http://127.0.0.1:9",
}


def test_missing_settings_are_named(monkeypatch):
    monkeypatch.setenv("PDSERVE_PLANNER_NAMESPACE", "serving")
    result = CliRunner().invoke(app, ["planner"])
    assert result.exit_code == 2
    named = ("needs PDSERVE_PLANNER_PREFILL_DEPLOYMENT, PDSERVE_PLANNER_DECODE_DEPLOYMENT, "
             "PDSERVE_PLANNER_PROMETHEUS_URL, PDSERVE_PLANNER_PROFILE_PATH")  # fmt: skip
    assert named in result.output


def test_an_unreadable_profile_is_named(monkeypatch, tmp_path):
    for name, value in CLUSTER.items():
        monkeypatch.setenv(name, value)
    path = tmp_path / "profile.json"
    path.write_text('{"prefill": {}}')
    monkeypatch.setenv("PDSERVE_PLANNER_PROFILE_PATH", str(path))
    result = CliRunner().invoke(app, ["planner"])
    assert result.exit_code == 2
    assert f"PDSERVE_PLANNER_PROFILE_PATH={path}: KeyError('decode')" in result.output


def test_invalid_settings_are_a_usage_error(monkeypatch):
    monkeypatch.setenv("PDSERVE_PLANNER_PREDICTOR", "arima")
    result = CliRunner().invoke(app, ["planner"])
    assert result.exit_code == 2 and "predictor" in result.output
