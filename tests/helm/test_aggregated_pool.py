"""The optional aggregated pool: off by default; on, a Deployment running `pdserve decode
--aggregated` with its own Service, PDB, autoscaler and network policy, beside the two pools or
instead of them; valid for Kubernetes and held to the values schema."""

import pytest

from .chart import CHART, HelmFailed, component, container, find, of_kind
from .test_kubernetes_validate import validate

BESIDE = """
aggregated:
  enabled: true
  replicas: 3
  autoscaling: {enabled: true, metric: pdserve_prefill_queued_tokens, target: 8192}
networkPolicy: {enabled: true}
metrics: {serviceMonitor: {enabled: true}}
"""
INSTEAD = """
aggregated: {enabled: true, replicas: 2}
prefill: {replicas: 0, autoscaling: {enabled: false}}
decode: {replicas: 0, autoscaling: {enabled: false}}
"""


@pytest.fixture
def render(helm, tmp_path):
    def run(values_yaml: str):
        values_file = tmp_path / "values.yaml"
        values_file.write_text(values_yaml)
        return values_file, helm.template(values_file)

    return run


def test_off_by_default(default_docs):
    assert not [d for d in default_docs if d["metadata"]["name"] == component("aggregated")]


def test_beside_the_two_pools(helm, render):
    values_file, docs = render(BESIDE)
    deployment = find(docs, "Deployment", component("aggregated"))
    assert container(deployment)["args"] == [
        "decode", "--aggregated", "--host=0.0.0.0", "--port=50063", "--metrics-port=9400",
    ]  # fmt: skip
    assert "replicas" not in deployment["spec"]  # the HPA owns the count
    hpa = find(docs, "HorizontalPodAutoscaler", component("aggregated"))
    assert hpa["spec"]["metrics"][0]["pods"]["metric"]["name"] == "pdserve_prefill_queued_tokens"
    assert find(docs, "Service", component("aggregated"))["spec"]["clusterIP"] == "None"
    find(docs, "PodDisruptionBudget", component("aggregated"))
    # Every pool admits the other pools' pods (KV transfer), and Redis admits them all.
    for pool in ("prefill", "decode", "aggregated"):
        policy = find(docs, "NetworkPolicy", component(pool))
        peers = [p["podSelector"]["matchLabels"]["app.kubernetes.io/component"]
                 for p in policy["spec"]["ingress"][1]["from"]]  # fmt: skip
        assert peers == ["prefill", "decode", "aggregated"]
    redis = find(docs, "NetworkPolicy", component("redis"))
    clients = [p["podSelector"]["matchLabels"]["app.kubernetes.io/component"]
               for p in redis["spec"]["ingress"][0]["from"]]  # fmt: skip
    assert clients == ["router", "prefill", "decode", "aggregated"]
    (monitor,) = of_kind(docs, "ServiceMonitor")
    (selector,) = monitor["spec"]["selector"]["matchExpressions"]
    assert "aggregated" in selector["values"]

    results = validate(docs, ["1.33"])
    assert [r for r in results if r["error"]] == []
    lint = helm.run("lint", "--strict", str(CHART), "--values", str(values_file))
    assert lint.returncode == 0, lint.stdout + lint.stderr


def test_instead_of_the_two_pools(render):
    _, docs = render(INSTEAD)
    replicas = {pool: find(docs, "Deployment", component(pool))["spec"]["replicas"]
                for pool in ("prefill", "decode", "aggregated")}  # fmt: skip
    assert replicas == {"prefill": 0, "decode": 0, "aggregated": 2}
    assert not of_kind(docs, "HorizontalPodAutoscaler")


def test_schema_holds_the_pool_to_its_keys(render):
    with pytest.raises(HelmFailed) as failed:
        render("aggregated:\n  enabled: yes-please\n")
    assert "- at '/aggregated/enabled': got string, want boolean" in failed.value.stderr
    with pytest.raises(HelmFailed) as failed:
        render("aggregated:\n  autoscaling:\n    metric: pdserve_router_queue_depth\n")
    assert "- at '/aggregated/autoscaling/metric': value must be one of" in failed.value.stderr
