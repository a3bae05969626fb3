"""`pdserve sim seed-study` without matplotlib (a dev extra; the container image has none):
the study runs and writes its JSON, only the PNG plots are left out."""

from __future__ import annotations

import json
import subprocess
import sys

# sys.modules["matplotlib"] = None makes every `import matplotlib` raise ImportError.
SCRIPT = """
import sys
sys.modules["matplotlib"] = None
from pdserve.cli import app
app(["sim", "seed-study", "--requests", "48", "--out", sys.argv[1]])
"""


def test_seed_study_runs_without_matplotlib(tmp_path):
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path)], capture_output=True,
                          text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    last = json.loads(proc.stdout.strip().splitlines()[-1])
    assert json.loads((tmp_path / "seed-study.json").read_text()) == last
    assert not list(tmp_path.glob("*.png"))
