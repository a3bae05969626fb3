"""`checkov --framework helm` on the chart: no failed check; every suppression has its reason.

checkov renders the chart itself (`helm template`, found on PATH) and drops a chart whose render
writes anything to stderr without failing, so the tests also check that every workload was seen.
HELM_NAMESPACE makes that render use a real release namespace, as `helm install -n` does.
"""

import json
import subprocess

import pytest

from .chart import ALL_ON_VALUES, CHART, PLANNER_VALUES, tool_path, tools_env

CHECKOV_RELEASE = "release-name"  # the name checkov's own `helm template` gives the release


@pytest.fixture(scope="module")
def checkov_reports(tmp_path_factory) -> dict[str, dict]:
    """checkov once per values file, both at once (it is the slow part of this suite)."""
    checkov = tool_path("checkov")
    tool_path("helm")
    env = tools_env(tmp_path_factory.mktemp("checkov-helm-home"))
    env["HELM_NAMESPACE"] = "pdserve"
    runs = {
        "default": [],
        "all-on": ["--var-file", str(ALL_ON_VALUES)],
        "planner": ["--var-file", str(PLANNER_VALUES)],
    }
    procs = {
        name: subprocess.Popen(
            [
                str(checkov),
                "--directory",
                str(CHART),
                "--framework",
                "helm",
                "--skip-download",
                "--output",
                "json",
                *extra,
            ],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        for name, extra in runs.items()
    }
    reports = {}
    for name, proc in procs.items():
        stdout, stderr = proc.communicate(timeout=300)
        assert proc.returncode == 0, f"checkov ({name}) exited {proc.returncode}:\n{stderr}"
        report = json.loads(stdout)
        # An empty report (a bare summary) means checkov's own `helm template` failed.
        assert isinstance(report, dict) and report.get("check_type") == "helm", (
            f"checkov ({name}) scanned nothing; does `helm template` render cleanly?\n"
            f"{stdout[:1000]}\n{stderr[-3000:]}"
        )
        reports[name] = report
    return reports


def checked_resources(report: dict) -> set[str]:
    results = report["results"]
    return {c["resource"] for kind in ("passed_checks", "skipped_checks") for c in results[kind]}


@pytest.mark.parametrize("values", ["default", "all-on", "planner"])
def test_no_failed_checks(checkov_reports, values):
    report = checkov_reports[values]
    failed = [
        f"{c['check_id']} {c['resource']}: {c['check_name']}"
        for c in report["results"]["failed_checks"]
    ]
    assert failed == []
    assert report["summary"]["parsing_errors"] == 0
    assert report["summary"]["passed"] > 300

    workloads = [("Deployment", role) for role in ("router", "prefill", "decode")]
    workloads += [("StatefulSet", "redis"), ("ConfigMap", "config")]
    if values == "planner":
        workloads += [("Deployment", "planner"), ("Role", "planner"), ("RoleBinding", "planner")]
    for kind, name in workloads:
        assert f"{kind}.pdserve.{CHECKOV_RELEASE}-pdserve-{name}" in checked_resources(report)


def test_suppressions_are_exactly_these_with_reasons(checkov_reports):
    suppressed = {
        values: sorted(
            (c["check_id"], c["resource"].replace(f".pdserve.{CHECKOV_RELEASE}-pdserve-", "."))
            for c in report["results"]["skipped_checks"]
        )
        for values, report in checkov_reports.items()
    }
    assert suppressed == {
        # No digest exists before the image is built; all-on sets image.digest, so none there.
        "default": [
            ("CKV_K8S_43", "Deployment.decode"),
            ("CKV_K8S_43", "Deployment.prefill"),
            ("CKV_K8S_43", "Deployment.router"),
            ("CKV_K8S_43", "StatefulSet.redis"),
        ],
        # The router's API key comes from a Secret as an env var (the CLI's interface); decode
        # adds IPC_LOCK through containerSecurityContext (RDMA memory registration).
        "all-on": [
            ("CKV_K8S_25", "Deployment.decode"),
            ("CKV_K8S_35", "Deployment.router"),
        ],
        # The planner is the one role that calls the Kubernetes API: it mounts its token.
        "planner": [
            ("CKV_K8S_38", "Deployment.planner"),
            ("CKV_K8S_43", "Deployment.decode"),
            ("CKV_K8S_43", "Deployment.planner"),
            ("CKV_K8S_43", "Deployment.prefill"),
            ("CKV_K8S_43", "Deployment.router"),
            ("CKV_K8S_43", "StatefulSet.redis"),
        ],
    }
    for report in checkov_reports.values():
        for check in report["results"]["skipped_checks"]:
            reason = check["check_result"]["suppress_comment"]
            assert len(reason) > 40 and reason != "No comment provided", check["check_id"]
