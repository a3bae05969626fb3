"""`pdserve sim seed-study` end to end at a small size: the table, then the JSON line."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from pdserve.cli import app


def test_seed_study_prints_its_json_last(tmp_path):
    result = CliRunner().invoke(app, ["sim", "seed-study", "--requests", "48", "--out",
                                      str(tmp_path)])  # fmt: skip
    assert result.exit_code == 0, result.output
    last = json.loads(result.output.strip().splitlines()[-1])
    assert list(last["steps"]) == ["baseline", "chunked", "watermark", "kv_reclaim"]
    for step in ("chunked", "watermark", "kv_reclaim"):
        assert {"throughput_vs_baseline", "p99_vs_baseline", "util_std"} <= set(last["steps"][step])
    assert {"p99_fifo_s", "p99_priority_s"} <= set(last["priority_ablation"])
    assert json.loads((tmp_path / "seed-study.json").read_text()) == last
    assert (tmp_path / "seed-baseline-ttft-cdf.png").stat().st_size > 0
