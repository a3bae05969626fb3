"""The optional SLA planner: its objects, its Role's exact rules, the refusal of a pool with
both an autoscaler and the planner, and strict validation of the render."""

import pytest

from .chart import (
    NAMESPACE,
    PLANNER_VALUES,
    HelmFailed,
    component,
    container,
    env_by_name,
    find,
    of_kind,
    pod_spec,
)
from .test_kubernetes_validate import KUBE_VERSIONS, validate


@pytest.fixture(scope="module")
def planner_docs(helm):
    return helm.template(PLANNER_VALUES)


def test_planner_objects_and_no_autoscaler(planner_docs):
    planner = component("planner")
    names = {(d["kind"], d["metadata"]["name"]) for d in planner_docs}
    kinds = ("ServiceAccount", "Role", "RoleBinding", "Deployment", "NetworkPolicy", "ConfigMap")
    assert {(kind, planner) for kind in kinds} <= names
    assert of_kind(planner_docs, "HorizontalPodAutoscaler") == []
    # The planner owns the pools' counts: a helm upgrade must not reset them.
    for pool in ("prefill", "decode"):
        assert "replicas" not in find(planner_docs, "Deployment", component(pool))["spec"]


def test_role_allows_only_the_scale_of_the_two_pools_and_pod_patches(planner_docs):
    role = find(planner_docs, "Role", component("planner"))
    assert role["metadata"]["namespace"] == NAMESPACE
    assert role["rules"] == [
        {"apiGroups": ["apps"], "resources": ["deployments/scale"],
         "resourceNames": [component("prefill"), component("decode")], "verbs": ["get", "patch"]},
        {"apiGroups": [""], "resources": ["pods"], "verbs": ["patch"]},
    ]  # fmt: skip
    binding = find(planner_docs, "RoleBinding", component("planner"))
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                                  "name": component("planner")}  # fmt: skip
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": component("planner"),
                                    "namespace": NAMESPACE}]  # fmt: skip


def test_planner_pod_runs_with_its_own_account_and_settings(planner_docs):
    deployment = find(planner_docs, "Deployment", component("planner"))
    spec = pod_spec(deployment)
    assert deployment["spec"]["replicas"] == 1
    assert (spec["serviceAccountName"], spec["automountServiceAccountToken"]) == (
        component("planner"), True)  # fmt: skip
    assert container(deployment)["args"] == ["planner"]
    env = {name: e.get("value") for name, e in env_by_name(deployment).items()}
    assert env | {"PDSERVE_PLANNER_NAMESPACE": None} == {
        "PDSERVE_PLANNER_NAMESPACE": None,  # from the downward API
        "PDSERVE_PLANNER_PREFILL_DEPLOYMENT": component("prefill"),
        "PDSERVE_PLANNER_DECODE_DEPLOYMENT": component("decode"),
        "PDSERVE_PLANNER_PROMETHEUS_URL": "http://prometheus-operated.monitoring.svc:9090",
        "PDSERVE_PLANNER_PROFILE_PATH": "/etc/pdserve/planner/profile.json",
        "PDSERVE_PLANNER_METRICS_PORT": "9402",
        "PDSERVE_PLANNER_TTFT_TARGET_S": "0.5",
        "PDSERVE_PLANNER_ITL_TARGET_S": "0.05",
        "PDSERVE_PLANNER_INTERVAL_S": "60",
        "PDSERVE_PLANNER_PREDICTOR": "ewma",
        "PDSERVE_PLANNER_MIN_PREFILL": "1",
        "PDSERVE_PLANNER_MAX_PREFILL": "7",
        "PDSERVE_PLANNER_MIN_DECODE": "1",
        "PDSERVE_PLANNER_MAX_DECODE": "7",
        "PDSERVE_PLANNER_GPUS_PER_PREFILL": "2",
        "PDSERVE_PLANNER_GPUS_PER_DECODE": "2",
        "PDSERVE_PLANNER_GPU_BUDGET": "16",
        "PDSERVE_PLANNER_SCALE_DOWN_COOLDOWN_S": "300",
    }


def test_the_profile_reaches_the_pod_as_the_planner_reads_it(planner_docs, tmp_path):
    from planner.profile import Profile

    config_map = find(planner_docs, "ConfigMap", component("planner"))
    (tmp_path / "profile.json").write_text(config_map["data"]["profile.json"])
    profile = Profile.load(tmp_path / "profile.json")
    assert profile.prefill.prompt_tokens == (512, 4096)
    assert profile.decode.itl(64, 4096) == 0.045
    spec = pod_spec(find(planner_docs, "Deployment", component("planner")))
    assert {"name": "profile", "configMap": {"name": component("planner")}} in spec["volumes"]


def test_the_planner_needs_a_profile(helm):
    with pytest.raises(HelmFailed) as failed:
        helm.template(PLANNER_VALUES, set_values=("planner.profile=null",))
    assert "planner.enabled needs planner.profile" in failed.value.stderr


def test_planner_env_names_are_its_settings():
    from planner.settings import PlannerSettings

    names = {f"PDSERVE_PLANNER_{field.upper()}" for field in PlannerSettings.model_fields}
    rendered = (PLANNER_VALUES.parent.parent / "templates" / "planner.yaml").read_text()
    used = {
        word for word in rendered.replace(",", " ").split() if word.startswith("PDSERVE_PLANNER_")
    }
    assert used <= names


@pytest.mark.parametrize("pool", ["prefill", "decode"])
def test_a_pool_with_an_autoscaler_and_the_planner_is_refused(helm, pool):
    with pytest.raises(HelmFailed) as failed:
        helm.template(PLANNER_VALUES, set_values=(f"{pool}.autoscaling.enabled=true",))
    refusal = (f"planner.enabled and {pool}.autoscaling.enabled: both would set the {pool} "
               f"Deployment's replicas; turn {pool}.autoscaling off")  # fmt: skip
    assert refusal in failed.value.stderr


def test_schema_refuses_an_unknown_predictor(helm):
    with pytest.raises(HelmFailed) as failed:
        helm.template(PLANNER_VALUES, set_values=("planner.predictor=arima",))
    assert "'/planner/predictor': value must be one of 'constant', 'ewma', 'holt'" in (
        failed.value.stderr
    )


@pytest.mark.parametrize("kube_version", KUBE_VERSIONS)
def test_planner_render_is_valid(helm, kube_version):
    docs = helm.template(PLANNER_VALUES, kube_version=f"{kube_version}.0")
    results = validate(docs, [kube_version])
    assert {"Role", "RoleBinding"} <= {r["kind"] for r in results}
    assert len(results) == len(docs)
    assert [r for r in results if r["error"]] == []
