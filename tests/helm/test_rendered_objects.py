"""Exact assertions on the objects the chart renders (default values and all-on values)."""

import json

import pytest
import yaml

from .chart import (
    ALL_ON_VALUES,
    CHART,
    NAMESPACE,
    RELEASE,
    ROOT,
    HelmFailed,
    component,
    container,
    env_by_name,
    find,
    of_kind,
    pod_spec,
)

VALUES = yaml.safe_load((CHART / "values.yaml").read_text())
ALL_ON = yaml.safe_load(ALL_ON_VALUES.read_text())
ROLES = ["router", "prefill", "decode"]
WORKERS = ["prefill", "decode"]


def selector(name: str) -> dict:
    return {
        "app.kubernetes.io/name": "pdserve",
        "app.kubernetes.io/instance": RELEASE,
        "app.kubernetes.io/component": name,
    }


def test_default_objects(default_docs):
    assert sorted((d["kind"], d["metadata"]["name"]) for d in default_docs) == sorted(
        [
            ("ServiceAccount", "rel-pdserve"),
            ("ConfigMap", "rel-pdserve-config"),
            *[(kind, component(role)) for role in ROLES for kind in ("Deployment", "Service")],
            *[("PodDisruptionBudget", component(role)) for role in ROLES],
            *[("HorizontalPodAutoscaler", component(role)) for role in WORKERS],
            *[("NetworkPolicy", component(role)) for role in [*ROLES, "redis"]],
            ("StatefulSet", "rel-pdserve-redis"),
            ("Service", "rel-pdserve-redis"),
        ]
    )
    assert {d["metadata"]["namespace"] for d in default_docs} == {NAMESPACE}


# --- autoscaling: one autoscaler per pool, each on its own pool's signal ---


def test_two_hpas_scale_two_deployments_on_their_own_metrics(default_docs):
    hpas = {
        h["metadata"]["name"]: h["spec"] for h in of_kind(default_docs, "HorizontalPodAutoscaler")
    }
    assert set(hpas) == {"rel-pdserve-prefill", "rel-pdserve-decode"}

    expected = {
        "prefill": ("pdserve_prefill_queued_tokens", "16384"),
        "decode": ("pdserve_kv_cache_usage_ratio", "0.75"),
    }
    for pool, (metric, target) in expected.items():
        spec = hpas[component(pool)]
        autoscaling = VALUES[pool]["autoscaling"]
        assert spec["scaleTargetRef"] == {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "name": component(pool),
        }
        assert spec["metrics"] == [
            {
                "type": "Pods",
                "pods": {
                    "metric": {"name": metric},
                    "target": {"type": "AverageValue", "averageValue": target},
                },
            }
        ]
        assert (spec["minReplicas"], spec["maxReplicas"]) == (1, 8)
        assert spec["behavior"] == autoscaling["behavior"]
        find(default_docs, "Deployment", spec["scaleTargetRef"]["name"])

    assert hpas[component("prefill")]["behavior"] != hpas[component("decode")]["behavior"]
    # The HPA owns the count: a rendered `replicas` would reset it on every upgrade.
    for pool in WORKERS:
        assert "replicas" not in find(default_docs, "Deployment", component(pool))["spec"]


def test_prefill_values_leave_decode_untouched(helm, default_docs):
    changed = helm.template(
        set_values=(
            "prefill.replicas=5",
            "prefill.autoscaling.enabled=false",
            "prefill.resources.requests.cpu=16",
            "prefill.resources.limits.cpu=16",
        )
    )

    def rendered(docs, name):
        return sorted(json.dumps(d, sort_keys=True) for d in docs if d["metadata"]["name"] == name)

    decode_kinds = {d["kind"] for d in default_docs if d["metadata"]["name"] == component("decode")}
    assert decode_kinds == {
        "Deployment", "Service", "PodDisruptionBudget", "HorizontalPodAutoscaler", "NetworkPolicy"
    }  # fmt: skip
    names = {d["metadata"]["name"] for d in default_docs} - {component("prefill")}
    for name in names:
        assert rendered(changed, name) == rendered(default_docs, name), name
    prefill = find(changed, "Deployment", component("prefill"))
    assert prefill["spec"]["replicas"] == 5
    assert container(prefill)["resources"]["requests"]["cpu"] == 16
    assert [h["metadata"]["name"] for h in of_kind(changed, "HorizontalPodAutoscaler")] == [
        component("decode")
    ]


def test_keda_scaled_objects_replace_the_hpas(all_on_docs):
    assert of_kind(all_on_docs, "HorizontalPodAutoscaler") == []
    scaled = {s["metadata"]["name"]: s["spec"] for s in of_kind(all_on_docs, "ScaledObject")}
    assert set(scaled) == {component("prefill"), component("decode")}

    pods = 'namespace="pdserve",pod=~"{}-[a-z0-9]+-[a-z0-9]+"'
    decode_pods = pods.format(component("decode"))
    prefill_wait = (
        "histogram_quantile(0.9, sum by (le) "
        f"(rate(pdserve_prefill_queue_wait_seconds_bucket{{{pods.format(component('prefill'))}}}[2m])))"
    )
    expected_triggers = {
        "prefill": {
            "type": "prometheus",
            "name": "pdserve_prefill_queue_wait_seconds_p90",
            "metricType": "Value",
            "metadata": {
                "serverAddress": "http://prometheus.monitoring.svc:9090",
                "query": prefill_wait,
                "threshold": "0.5",
            },
        },
        "decode": {
            "type": "prometheus",
            "name": "pdserve_decode_running_requests",
            "metricType": "AverageValue",
            "metadata": {
                "serverAddress": "http://prometheus.monitoring.svc:9090",
                "query": f"sum(pdserve_decode_running_requests{{{decode_pods}}})",
                "threshold": "64",
            },
        },
    }
    for pool, trigger in expected_triggers.items():
        spec = scaled[component(pool)]
        autoscaling = ALL_ON[pool]["autoscaling"]
        assert spec["scaleTargetRef"] == {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "name": component(pool),
        }
        assert spec["triggers"] == [trigger]
        assert (spec["minReplicaCount"], spec["maxReplicaCount"]) == (
            autoscaling["minReplicas"],
            autoscaling["maxReplicas"],
        )
        assert spec["advanced"]["horizontalPodAutoscalerConfig"] == {
            "name": component(pool),
            "behavior": VALUES[pool]["autoscaling"]["behavior"],
        }
    assert (
        scaled[component("prefill")]["pollingInterval"],
        scaled[component("prefill")]["cooldownPeriod"],
    ) == (10, 120)
    assert (
        scaled[component("decode")]["pollingInterval"],
        scaled[component("decode")]["cooldownPeriod"],
    ) == (15, 600)


# --- pods: probes, drain, placement, security ---

GRPC_PORTS = {"router": 50051, "prefill": 50061, "decode": 50062}


@pytest.mark.parametrize("role", ROLES)
def test_grpc_probes_and_drain(default_docs, all_on_docs, role):
    # The startup probe allows startupTimeoutSeconds for model load and warm-up (10 s periods).
    startup_failures = {"router": (30, 12), "prefill": (90, 90), "decode": (90, 90)}[role]
    for docs, failures in zip((default_docs, all_on_docs), startup_failures, strict=True):
        c = container(find(docs, "Deployment", component(role)))
        grpc = {"grpc": {"port": GRPC_PORTS[role]}}
        assert c["startupProbe"] == {**grpc, "periodSeconds": 10, "failureThreshold": failures}
        assert c["readinessProbe"] == {
            **grpc,
            "periodSeconds": 5,
            "timeoutSeconds": 2,
            "failureThreshold": 2,
        }
        assert c["livenessProbe"] == {
            **grpc,
            "periodSeconds": 10,
            "timeoutSeconds": 5,
            "failureThreshold": 6,
        }

    # preStop sleep, then SIGTERM starts the drain; the kubelet waits for both plus 15 s.
    expected = {  # (preStop sleep, terminationGracePeriodSeconds) for default, all-on
        "router": ((5, 5 + 60 + 15), (10, 10 + 120 + 15)),
        "prefill": ((5, 5 + 60 + 15), (10, 10 + 120 + 15)),
        "decode": ((5, 5 + 60 + 15), (5, 5 + 120 + 15)),
    }[role]
    for docs, (sleep_s, grace_s) in zip((default_docs, all_on_docs), expected, strict=True):
        workload = find(docs, "Deployment", component(role))
        assert container(workload)["lifecycle"] == {
            "preStop": {"exec": {"command": ["sleep", str(sleep_s)]}}
        }
        assert pod_spec(workload)["terminationGracePeriodSeconds"] == grace_s


def test_container_args_and_ports(default_docs):
    expected = {
        "router": (
            ["router", "--host=0.0.0.0", "--http-port=8000", "--grpc-port=50051"],
            {"http": 8000, "grpc": 50051},
        ),
        "prefill": (
            ["prefill", "--host=0.0.0.0", "--port=50061", "--metrics-port=9400"],
            {"grpc": 50061, "metrics": 9400},
        ),
        "decode": (
            ["decode", "--host=0.0.0.0", "--port=50062", "--metrics-port=9400"],
            {"grpc": 50062, "metrics": 9400},
        ),
    }
    for role, (args, ports) in expected.items():
        c = container(find(default_docs, "Deployment", component(role)))
        assert c["name"] == role
        assert c["image"] == "pdserve:0.1.0"
        assert c["args"] == args
        assert {p["name"]: p["containerPort"] for p in c["ports"]} == ports


def test_settings_configmap_and_env(default_docs, all_on_docs):
    assert find(default_docs, "ConfigMap", "rel-pdserve-config")["data"] == {
        "PDSERVE_MODEL": "smollm2-135m",
        "PDSERVE_DTYPE": "auto",
        "PDSERVE_ATTENTION_BACKEND": "auto",
        "PDSERVE_QUANTIZATION": "auto",
        "PDSERVE_KV_CACHE_DTYPE": "auto",
        "PDSERVE_KV_OFFLOAD_GB": "0",
        "PDSERVE_KV_BACKEND": "auto",
        "PDSERVE_PEER_FETCH": "true",
        "PDSERVE_CHUNK_SIZE": "1024",
        "PDSERVE_DRAIN_GRACE_S": "60",
        "PDSERVE_ROUTING_POLICY": "watermark",
        "PDSERVE_PREFILL_OVERFLOW": "queue",
        "PDSERVE_PREFIX_PREFILL_WEIGHT": "0.6",
        "PDSERVE_PREFIX_DECODE_WEIGHT": "0.5",
        "REDIS_URL": "redis://rel-pdserve-redis:6379/0",
    }
    for role in ROLES:
        workload = find(default_docs, "Deployment", component(role))
        assert container(workload)["envFrom"] == [{"configMapRef": {"name": "rel-pdserve-config"}}]
        env = env_by_name(workload)
        assert env["PDSERVE_ADVERTISE_HOST"] == {
            "name": "PDSERVE_ADVERTISE_HOST",
            "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}},
        }
        assert env["PDSERVE_WORKER_ID"] == {
            "name": "PDSERVE_WORKER_ID",
            "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}},
        }
        assert env["PDSERVE_CACHE"]["value"] == "/cache/pdserve"
        assert "PDSERVE_API_KEY" not in env and "PDSERVE_THREADS" not in env
    assert of_kind(default_docs, "Secret") == []

    # all-on: per-pool threads and KV blocks, and the API key from the chart-made Secret.
    for pool, (threads, blocks) in {"prefill": ("8", "4096"), "decode": ("4", "65536")}.items():
        env = env_by_name(find(all_on_docs, "Deployment", component(pool)))
        assert (env["PDSERVE_THREADS"]["value"], env["PDSERVE_NUM_BLOCKS"]["value"]) == (
            threads,
            blocks,
        )
        assert env["UCX_TLS"] == {"name": "UCX_TLS", "value": "rc,cuda_copy,cuda_ipc"}
    router_env = env_by_name(find(all_on_docs, "Deployment", component("router")))
    assert router_env["PDSERVE_API_KEY"]["valueFrom"] == {
        "secretKeyRef": {"name": "rel-pdserve-api-key", "key": "api-key"}
    }
    assert find(all_on_docs, "Secret", "rel-pdserve-api-key")["data"] == {"api-key": "Y2hhbmdlLW1l"}
    all_on_config = find(all_on_docs, "ConfigMap", "rel-pdserve-config")["data"]
    assert (all_on_config["PDSERVE_QUANTIZATION"], all_on_config["PDSERVE_KV_CACHE_DTYPE"]) == (
        "int8",
        "int8",
    )
    assert all_on_config["PDSERVE_PEER_FETCH"] == "false"


def test_external_redis_from_a_secret(helm):
    docs = helm.template(
        set_values=("redis.enabled=false", "redis.external.existingSecret=registry-url")
    )
    assert of_kind(docs, "StatefulSet") == []
    assert component("redis") not in {d["metadata"]["name"] for d in docs}
    assert "REDIS_URL" not in find(docs, "ConfigMap", "rel-pdserve-config")["data"]
    for role in ROLES:
        assert env_by_name(find(docs, "Deployment", component(role)))["REDIS_URL"] == {
            "name": "REDIS_URL",
            "valueFrom": {"secretKeyRef": {"name": "registry-url", "key": "redis-url"}},
        }


def test_gpus_and_placement_per_pool(helm, default_docs, all_on_docs):
    for docs, gpus in (
        (default_docs, {"prefill": 1, "decode": 1}),
        (all_on_docs, {"prefill": 2, "decode": 1}),
    ):
        for pool, count in gpus.items():
            resources = container(find(docs, "Deployment", component(pool)))["resources"]
            assert resources["requests"]["nvidia.com/gpu"] == count
            assert resources["limits"]["nvidia.com/gpu"] == count
    router = container(find(default_docs, "Deployment", component("router")))["resources"]
    assert "nvidia.com/gpu" not in router["requests"] | router["limits"]

    cpu_only = helm.template(set_values=("prefill.gpus=0",))
    assert (
        "nvidia.com/gpu"
        not in container(find(cpu_only, "Deployment", component("prefill")))["resources"]["limits"]
    )

    def preferred_gpus(docs, pool):
        affinity = pod_spec(find(docs, "Deployment", component(pool)))["affinity"]
        (term,) = affinity["nodeAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"]
        (expression,) = term["preference"]["matchExpressions"]
        assert expression["key"] == "nvidia.com/gpu.product"
        return expression["values"]

    assert preferred_gpus(default_docs, "prefill") == ["NVIDIA-H100-80GB-HBM3", "NVIDIA-B200"]
    assert preferred_gpus(default_docs, "decode") == ["NVIDIA-H200", "NVIDIA-H20"]
    for pool in WORKERS:
        assert pod_spec(find(default_docs, "Deployment", component(pool)))["tolerations"] == [
            {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
        ]
    assert pod_spec(find(all_on_docs, "Deployment", component("prefill")))["nodeSelector"] == {
        "pdserve.io/gpu-pool": "compute"
    }
    assert pod_spec(find(all_on_docs, "Deployment", component("decode")))["nodeSelector"] == {
        "pdserve.io/gpu-pool": "bandwidth"
    }


DEVICE_ENV = (
    "PDSERVE_DEVICE",
    "PDSERVE_CUDA_GRAPHS",
    "CUDA_CACHE_PATH",
    "FLASHINFER_WORKSPACE_BASE",
)
GPU_POOL_ENV = {
    "PDSERVE_DEVICE": "cuda",
    "PDSERVE_CUDA_GRAPHS": "true",
    "CUDA_CACHE_PATH": "/cache/nv",
    "FLASHINFER_WORKSPACE_BASE": "/cache",
}


def device_env(docs, role: str) -> dict[str, str]:
    env = env_by_name(find(docs, "Deployment", component(role)))
    return {name: env[name]["value"] for name in DEVICE_ENV if name in env}


def test_the_device_env_of_both_pools_follows_their_gpus(helm, default_docs, all_on_docs):
    for pool in WORKERS:
        assert device_env(default_docs, pool) == GPU_POOL_ENV
    assert device_env(default_docs, "router") == {}
    # all-on: prefill pods get 2 GPUs and are pinned to the second.
    assert device_env(all_on_docs, "prefill") == GPU_POOL_ENV | {"PDSERVE_DEVICE": "cuda:1"}
    assert device_env(all_on_docs, "decode") == GPU_POOL_ENV

    cpu_decode = helm.template(set_values=("decode.gpus=0", "decode.cudaGraphs=false"))
    assert device_env(cpu_decode, "decode") == {
        "PDSERVE_DEVICE": "cpu",
        "PDSERVE_CUDA_GRAPHS": "false",
    }
    assert device_env(cpu_decode, "prefill") == GPU_POOL_ENV


@pytest.mark.parametrize(
    ("set_values", "error"),
    [
        (
            ("decode.gpus=0", "decode.device=cuda"),
            "decode.device=cuda needs decode.gpus >= 1 (the pod would see no GPU)",
        ),
        (
            ("prefill.device=cuda:1",),
            "prefill.device=cuda:1, but the pod gets 1 GPU(s), numbered cuda:0..cuda:0",
        ),
        (("decode.device=gpu",), "at '/decode/device': 'gpu' does not match pattern"),
    ],
)
def test_a_device_the_pod_cannot_have_fails_the_render(helm, set_values, error):
    with pytest.raises(HelmFailed) as failure:
        helm.template(set_values=set_values)
    assert error in failure.value.stderr


WORKLOADS = [("Deployment", role) for role in ROLES] + [("StatefulSet", "redis")]


@pytest.mark.parametrize("kind, role", WORKLOADS, ids=[role for _, role in WORKLOADS])
def test_security_context(default_docs, all_on_docs, kind, role):
    for docs in (default_docs, all_on_docs):
        workload = find(docs, kind, component(role))
        pod = pod_spec(workload)
        assert pod["automountServiceAccountToken"] is False
        assert pod["securityContext"] == {
            "runAsNonRoot": True,
            "runAsUser": 10001,
            "runAsGroup": 10001,
            "fsGroup": 10001,
            "seccompProfile": {"type": "RuntimeDefault"},
        }
        context = container(workload)["securityContext"]
        assert context["allowPrivilegeEscalation"] is False
        assert context["readOnlyRootFilesystem"] is True
        assert context["privileged"] is False
        assert context["capabilities"]["drop"] == ["ALL"]
        mounts = {m["mountPath"]: m["name"] for m in container(workload)["volumeMounts"]}
        volumes = {v["name"]: v for v in pod["volumes"]}
        assert "emptyDir" in volumes[mounts["/tmp"]]
    if role == "decode":  # all-on adds IPC_LOCK (RDMA memory registration) and keeps drop: ALL
        context = container(find(all_on_docs, kind, component(role)))["securityContext"]
        assert context["capabilities"] == {"drop": ["ALL"], "add": ["IPC_LOCK"]}


def test_writable_volumes(default_docs, all_on_docs):
    prefill = find(default_docs, "Deployment", component("prefill"))
    assert pod_spec(prefill)["volumes"] == [
        {"name": "cache", "emptyDir": {"sizeLimit": "20Gi"}},
        {"name": "tmp", "emptyDir": {"sizeLimit": "1Gi"}},
        {"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": "8Gi"}},
    ]
    assert container(prefill)["volumeMounts"] == [
        {"name": "cache", "mountPath": "/cache"},
        {"name": "tmp", "mountPath": "/tmp"},
        {"name": "shm", "mountPath": "/dev/shm"},
    ]
    router = find(all_on_docs, "Deployment", component("router"))
    assert pod_spec(router)["volumes"] == [
        {"name": "cache", "persistentVolumeClaim": {"claimName": "pdserve-model-cache"}},
        {"name": "tmp", "emptyDir": {"sizeLimit": "2Gi"}},
    ]


# --- disruption budgets and network policies ---


def test_pod_disruption_budgets(default_docs, all_on_docs):
    for docs, router_max in ((default_docs, 1), (all_on_docs, "34%")):
        pdbs = {p["metadata"]["name"]: p["spec"] for p in of_kind(docs, "PodDisruptionBudget")}
        assert pdbs == {
            component("router"): {
                "maxUnavailable": router_max,
                "selector": {"matchLabels": selector("router")},
            },
            component("prefill"): {
                "maxUnavailable": 1,
                "selector": {"matchLabels": selector("prefill")},
            },
            component("decode"): {
                "maxUnavailable": 1,
                "selector": {"matchLabels": selector("decode")},
            },
        }
        for role in ROLES:
            pod_labels = find(docs, "Deployment", component(role))["spec"]["template"]["metadata"][
                "labels"
            ]
            assert selector(role).items() <= pod_labels.items()


def peer(role: str) -> dict:
    return {"podSelector": {"matchLabels": selector(role)}}


def test_network_policies(default_docs, all_on_docs):
    for docs, router_from, metrics_from in (
        (default_docs, None, [{"namespaceSelector": {}}]),
        (
            all_on_docs,
            [
                {
                    "namespaceSelector": {
                        "matchLabels": {"kubernetes.io/metadata.name": "ingress-nginx"}
                    }
                }
            ],
            [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}],
        ),
    ):
        policies = {p["metadata"]["name"]: p["spec"] for p in of_kind(docs, "NetworkPolicy")}
        router_rule = {
            "ports": [{"port": "http", "protocol": "TCP"}, {"port": "grpc", "protocol": "TCP"}]
        }
        if router_from:
            router_rule["from"] = router_from
        assert policies[component("router")] == {
            "podSelector": {"matchLabels": selector("router")},
            "policyTypes": ["Ingress"],
            "ingress": [router_rule],
        }
        for pool in WORKERS:
            assert policies[component(pool)] == {
                "podSelector": {"matchLabels": selector(pool)},
                "policyTypes": ["Ingress"],
                "ingress": [
                    # The router reaches the worker's gRPC port only ...
                    {"from": [peer("router")], "ports": [{"port": "grpc", "protocol": "TCP"}]},
                    # ... peer workers reach every port (KV transfer uses ephemeral ports) ...
                    {"from": [peer("prefill"), peer("decode")]},
                    # ... and the metrics port is open to the scrapers.
                    {"from": metrics_from, "ports": [{"port": "metrics", "protocol": "TCP"}]},
                ],
            }
        assert policies[component("redis")] == {
            "podSelector": {"matchLabels": selector("redis")},
            "policyTypes": ["Ingress"],
            "ingress": [
                {
                    "from": [peer("router"), peer("prefill"), peer("decode")],
                    "ports": [{"port": "redis", "protocol": "TCP"}],
                }
            ],
        }
        # Every named port in a policy exists on the pods it selects.
        for role in ROLES:
            names = {
                p["name"] for p in container(find(docs, "Deployment", component(role)))["ports"]
            }
            rules = policies[component(role)]["ingress"]
            assert {p["port"] for rule in rules for p in rule.get("ports", [])} <= names


# --- monitoring ---


def test_service_monitor_and_dashboard(default_docs, all_on_docs):
    assert of_kind(default_docs, "ServiceMonitor") == []
    (monitor,) = of_kind(all_on_docs, "ServiceMonitor")
    assert monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    assert monitor["spec"]["selector"] == {
        "matchLabels": {"app.kubernetes.io/name": "pdserve", "app.kubernetes.io/instance": RELEASE},
        "matchExpressions": [
            {"key": "app.kubernetes.io/component", "operator": "In", "values": ROLES}
        ],
    }
    assert [(e["port"], e["path"], e["interval"]) for e in monitor["spec"]["endpoints"]] == [
        ("http", "/metrics", "10s"),
        ("metrics", "/metrics", "10s"),
    ]
    for role, port in (("router", "http"), ("prefill", "metrics"), ("decode", "metrics")):
        service = find(all_on_docs, "Service", component(role))
        assert port in {p["name"] for p in service["spec"]["ports"]}

    dashboard_map = find(all_on_docs, "ConfigMap", "rel-pdserve-dashboard")
    assert dashboard_map["metadata"]["labels"]["grafana_dashboard"] == "1"
    dashboard = json.loads(dashboard_map["data"]["pdserve.json"])
    exprs = " ".join(t["expr"] for p in dashboard["panels"] for t in p["targets"])
    for metric in (
        "pdserve_prefill_queued_tokens",
        "pdserve_prefill_queue_wait_seconds_bucket",
        "pdserve_kv_cache_usage_ratio",
        "pdserve_decode_running_requests",
    ):
        assert metric in exprs


def test_image_digest_pins_the_image(all_on_docs):
    digest = ALL_ON["image"]["digest"]
    for role in ROLES:
        c = container(find(all_on_docs, "Deployment", component(role)))
        assert c["image"] == f"registry.example.com/pdserve@{digest}"
    redis = container(find(all_on_docs, "StatefulSet", component("redis")))
    assert redis["image"] == f"docker.io/valkey/valkey@{ALL_ON['redis']['image']['digest']}"


def test_documented_adapter_rules_serve_every_hpa_metric():
    """docs/kubernetes.md's prometheus-adapter rules name exactly the metrics HPAs may use."""
    text = (ROOT / "docs" / "kubernetes.md").read_text()
    blocks = [b.split("\n", 1)[1] for b in text.split("```")[1::2] if b.startswith("yaml")]
    (rules_yaml,) = [b for b in blocks if "seriesQuery" in b]
    rules = yaml.safe_load(rules_yaml)["rules"]["custom"]
    served = [rule["name"]["as"] for rule in rules]

    schema = json.loads((CHART / "values.schema.json").read_text())
    pools = schema["properties"]
    allowed = [
        metric
        for pool in WORKERS
        for metric in pools[pool]["properties"]["autoscaling"]["properties"]["metric"]["enum"]
    ]
    assert sorted(served) == sorted(allowed)
    for rule in rules:
        assert rule["resources"] == {
            "overrides": {"namespace": {"resource": "namespace"}, "pod": {"resource": "pod"}}
        }
