"""The rendered chart passes kubernetes-validate (strict) for Kubernetes 1.29 and 1.33.

The validator runs in .venv-tools' Python (kube_validate.py, through kubernetes-validate's
Python API): an unknown field or an apiVersion that the version does not serve is an error,
and the CRD kinds (ServiceMonitor, ScaledObject) are held to strict schemas of their own.
"""

import json
import subprocess
from pathlib import Path

import pytest
import yaml

from .chart import ALL_ON_VALUES, tool_path

VALIDATOR = Path(__file__).with_name("kube_validate.py")
KUBE_VERSIONS = ["1.29", "1.33"]


def validate(docs, versions) -> list[dict]:
    proc = subprocess.run(
        [str(tool_path("python")), str(VALIDATOR), *versions],
        input=yaml.safe_dump_all(docs),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


@pytest.mark.parametrize("kube_version", KUBE_VERSIONS)
@pytest.mark.parametrize(
    "values, expected_kinds",
    [
        (
            None,
            {
                "ConfigMap",
                "Deployment",
                "HorizontalPodAutoscaler",
                "NetworkPolicy",
                "PodDisruptionBudget",
                "Service",
                "ServiceAccount",
                "StatefulSet",
            },
        ),
        (
            ALL_ON_VALUES,
            {
                "ConfigMap",
                "Deployment",
                "NetworkPolicy",
                "PodDisruptionBudget",
                "ScaledObject",
                "Secret",
                "Service",
                "ServiceAccount",
                "ServiceMonitor",
                "StatefulSet",
            },
        ),
    ],
    ids=["default", "all-on"],
)
def test_rendered_chart_is_valid(helm, values, expected_kinds, kube_version):
    values_files = (values,) if values else ()
    docs = helm.template(*values_files, kube_version=f"{kube_version}.0")
    results = validate(docs, [kube_version])

    assert {r["kind"] for r in results} == expected_kinds
    assert len(results) == len(docs)
    assert [r for r in results if r["error"]] == []


BROKEN = """
apiVersion: autoscaling/v2beta2
kind: HorizontalPodAutoscaler
metadata: {name: removed-api}
spec: {scaleTargetRef: {kind: Deployment, name: x}, maxReplicas: 2}
---
apiVersion: v1
kind: ConfigMap
metadata: {name: unknown-field}
dat: {a: b}
---
apiVersion: monitoring.coreos.com/v1
kind: PodMonitor
metadata: {name: crd-without-schema}
spec: {}
---
apiVersion: keda.sh/v1alpha1
kind: ScaledObject
metadata: {name: numeric-threshold}
spec:
  scaleTargetRef: {name: x}
  triggers: [{type: prometheus, metadata: {threshold: 5}}]
---
apiVersion: monitoring.coreos.com/v1
kind: ServiceMonitor
metadata: {name: bad-interval}
spec: {selector: {}, endpoints: [{port: metrics, interval: 15}]}
"""


def test_validator_is_strict():
    """What makes the test above mean something: each of these must fail, with this reason."""
    results = validate(list(yaml.safe_load_all(BROKEN)), ["1.29"])
    assert {r["name"]: r["error"] for r in results} == {
        "removed-api": "Couldn't find schema for kind HorizontalPodAutoscaler with api version "
        "autoscaling/v2beta2 for kubernetes version 1.29",
        "unknown-field": "(root): Additional properties are not allowed ('dat' was unexpected)",
        "crd-without-schema": "Couldn't find schema for kind PodMonitor with api version "
        "monitoring.coreos.com/v1 for kubernetes version 1.29",
        "numeric-threshold": "spec/triggers/0/metadata/threshold: 5 is not of type 'string'",
        "bad-interval": "spec/endpoints/0/interval: 15 is not of type 'string'",
    }
