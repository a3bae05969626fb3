"""`pdserve planner` on a cluster: the planner loop with the Prometheus load source and the
Kubernetes connector, under the pod's own ServiceAccount, with its metrics on /metrics."""

from __future__ import annotations

from pathlib import Path

from prometheus_client import start_http_server

from planner.metrics import PlannerMetrics
from planner.planner import Planner
from planner.profile import Profile, ProfileError
from planner.prometheus import PrometheusSource
from planner.settings import PlannerSettings

NEEDED = ("namespace", "prefill_deployment", "decode_deployment", "prometheus_url",
          "profile_path")  # fmt: skip


class PlannerConfigError(ValueError):
    """A setting the cluster loop needs is missing or unreadable (names it)."""


def load_profile(settings: PlannerSettings) -> Profile:
    missing = [f"PDSERVE_PLANNER_{name.upper()}" for name in NEEDED if not getattr(settings, name)]
    if missing:
        raise PlannerConfigError("pdserve planner needs " + ", ".join(missing))
    try:
        return Profile.load(Path(settings.profile_path))
    except (OSError, KeyError, TypeError, ValueError, ProfileError) as e:
        raise PlannerConfigError(
            f"PDSERVE_PLANNER_PROFILE_PATH={settings.profile_path}: {e!r}"
        ) from e


def build(settings: PlannerSettings) -> Planner:
    """Everything that can be refused is checked here, before the loop starts."""
    profile = load_profile(settings)
    from kubernetes import client, config  # only the cluster loop needs the client

    from planner.kubernetes import KubernetesConnector

    config.load_incluster_config()
    source = PrometheusSource(settings.prometheus_url, settings.interval_s)
    connector = KubernetesConnector(
        client.AppsV1Api(), client.CoreV1Api(), settings.namespace,
        {"prefill": settings.prefill_deployment, "decode": settings.decode_deployment},
        source.pod_loads,
    )  # fmt: skip
    start_http_server(settings.metrics_port)
    return Planner(settings, profile, source, connector, PlannerMetrics())
