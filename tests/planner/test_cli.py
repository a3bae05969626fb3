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


def test_up_planner_refuses_a_bad_setting_before_anything_starts(monkeypatch):
    monkeypatch.setenv("PDSERVE_PLANNER_INTERVAL_S", "-1")
    result = CliRunner().invoke(app, ["up", "--planner", "--http-port", "0", "--grpc-port", "0"])
    assert result.exit_code == 2
    first_lines = "pdserve up: 1 validation error for PlannerSettings\ninterval_s\n"
    assert result.output.startswith(first_lines)


def test_up_planner_defaults_give_way_to_the_environment(monkeypatch):
    from pdserve.cli import LOCAL_PLANNER_DEFAULTS, local_planner_settings

    assert local_planner_settings().interval_s == LOCAL_PLANNER_DEFAULTS["interval_s"] == 20.0
    monkeypatch.setenv("PDSERVE_PLANNER_INTERVAL_S", "7")
    monkeypatch.setenv("PDSERVE_PLANNER_GPU_BUDGET", "5")
    settings = local_planner_settings()
    assert (settings.interval_s, settings.gpu_budget) == (7.0, 5)
    assert settings.scale_down_cooldown_s == 60.0  # a local default still
