"""The Kubernetes connector: each pool is a Deployment whose `scale` subresource the planner
reads and patches; before a scale-down the least-loaded pods are marked to be deleted first."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

from kubernetes.client import AppsV1Api, CoreV1Api
from kubernetes.client.exceptions import ApiException

from planner.connector import Connector, ConnectorError
from planner.settings import PoolName

# The ReplicaSet controller removes pods of lower cost first; unmarked pods cost 0.
DELETION_COST = "controller.kubernetes.io/pod-deletion-cost"
DELETE_FIRST_COST = "-1000"
FORBIDDEN, NOT_FOUND, CONFLICT = 403, 404, 409
MAX_CONFLICTS = 3  # another writer (kubectl scale, a rollout) won; re-read and try again

PodLoads = Callable[[PoolName], Mapping[str, float]]  # pool -> {pod name: running requests}


class ScaleError(ConnectorError):
    """A scale the API server refused (RBAC, or conflicts past MAX_CONFLICTS)."""


@dataclass(frozen=True)
class KubernetesConnector(Connector):
    apps: AppsV1Api
    core: CoreV1Api
    namespace: str
    deployments: Mapping[PoolName, str]  # pool -> Deployment name
    pod_loads: PodLoads

    def replicas(self) -> dict[PoolName, int]:
        return {pool: self._read(pool)[0] for pool in self.deployments}

    def set_replicas(self, pool: PoolName, count: int) -> None:
        name = self.deployments[pool]
        for _ in range(MAX_CONFLICTS):
            current, version = self._read(pool)
            if current == count:
                return
            if count < current:
                self._mark_for_deletion(pool, current - count)
            # The resourceVersion makes the write conditional: a scale someone else made since
            # the read is answered 409, never silently overwritten.
            body = {"metadata": {"resourceVersion": version}, "spec": {"replicas": count}}
            try:
                self.apps.patch_namespaced_deployment_scale(name, self.namespace, body)
                return
            except ApiException as e:
                if e.status != CONFLICT:
                    raise self._refused(e, f"scale deployment {name}") from e
        raise ScaleError(f"deployment {self.namespace}/{name}: {MAX_CONFLICTS} conflicting "
                         f"writes in a row while scaling to {count}")  # fmt: skip

    def _read(self, pool: PoolName) -> tuple[int, str]:
        name = self.deployments[pool]
        try:
            scale = self.apps.read_namespaced_deployment_scale(name, self.namespace)
        except ApiException as e:
            raise self._refused(e, f"read the scale of deployment {name}") from e
        return scale.spec.replicas or 0, scale.metadata.resource_version

    def _mark_for_deletion(self, pool: PoolName, num_pods: int) -> None:
        loads = self.pod_loads(pool)
        for pod in sorted(loads, key=lambda p: (loads[p], p))[:num_pods]:
            body = {"metadata": {"annotations": {DELETION_COST: DELETE_FIRST_COST}}}
            try:
                self.core.patch_namespaced_pod(pod, self.namespace, body)
            except ApiException as e:
                if e.status != NOT_FOUND:  # a pod already gone needs no mark
                    raise self._refused(e, f"annotate pod {pod}") from e

    def _refused(self, error: ApiException, action: str) -> ScaleError:
        hint = " (the planner's Role needs it)" if error.status == FORBIDDEN else ""
        return ScaleError(f"could not {action} in namespace {self.namespace}: HTTP "
                          f"{error.status} {error.reason}{hint}")  # fmt: skip
