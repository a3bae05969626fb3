"""The Kubernetes connector with the official client against a stand-in API server on
loopback that implements only what the planner calls: apps/v1 Deployment scale get and patch,
and pod patches. Asserts the exact requests, the resource versions, a 409 and a 403."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

# A dependency (pyproject.toml); skipped only in a venv made before it was added.
kubernetes = pytest.importorskip("kubernetes")

from kubernetes.client import ApiClient, AppsV1Api, Configuration, CoreV1Api  # noqa: E402

from planner.kubernetes import DELETION_COST, KubernetesConnector, ScaleError  # noqa: E402

NAMESPACE = "serving"
SCALE = f"/apis/apps/v1/namespaces/{NAMESPACE}/deployments/{{}}/scale"
POD = f"/api/v1/namespaces/{NAMESPACE}/pods/{{}}"
MERGE = "application/strategic-merge-patch+json"


@dataclass
class ApiState:
    replicas: dict[str, int]
    versions: dict[str, int] = field(default_factory=dict)
    annotations: dict[str, dict[str, str]] = field(default_factory=dict)
    requests: list[tuple[str, str, str | None, dict | None]] = field(default_factory=list)
    forbidden: set[tuple[str, str]] = field(default_factory=set)  # (method, path)
    # Before the next scale patch, another writer changes the Deployment this many times.
    interleaved_writes: int = 0


class StandIn(BaseHTTPRequestHandler):
    state: ApiState

    def log_message(self, *args: object) -> None:
        pass

    def _reply(self, status: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _status(self, code: int, reason: str) -> None:
        self._reply(code, {"kind": "Status", "apiVersion": "v1", "status": "Failure",
                           "reason": reason, "code": code})  # fmt: skip

    def _scale(self, name: str) -> dict:
        s = self.state
        return {"apiVersion": "autoscaling/v1", "kind": "Scale",
                "metadata": {"name": name, "namespace": NAMESPACE,
                             "resourceVersion": str(s.versions.setdefault(name, 100))},
                "spec": {"replicas": s.replicas[name]},
                "status": {"replicas": s.replicas[name]}}  # fmt: skip

    def _handle(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        body = json.loads(self.rfile.read(length)) if length else None
        s = self.state
        s.requests.append((self.command, self.path, self.headers.get("Content-Type"), body))
        if (self.command, self.path) in s.forbidden:
            return self._status(403, "Forbidden")
        for name in s.replicas:
            if self.path == SCALE.format(name):
                return self._on_scale(name, body)
        pod = self.path.removeprefix(POD.format(""))
        if self.command == "PATCH" and pod in s.annotations:
            s.annotations[pod].update(body["metadata"]["annotations"])
            return self._reply(200, {"apiVersion": "v1", "kind": "Pod",
                                     "metadata": {"name": pod, "namespace": NAMESPACE,
                                                  "annotations": s.annotations[pod]}})  # fmt: skip
        return self._status(404, "NotFound")

    def _on_scale(self, name: str, body: dict | None) -> None:
        s = self.state
        if self.command == "PATCH":
            if s.interleaved_writes:
                s.interleaved_writes -= 1
                s.versions[name] += 1
            if body["metadata"]["resourceVersion"] != str(s.versions[name]):
                return self._status(409, "Conflict")
            s.replicas[name] = body["spec"]["replicas"]
            s.versions[name] += 1
        return self._reply(200, self._scale(name))

    do_GET = do_PATCH = _handle


@pytest.fixture
def api() -> Iterator[ApiState]:
    pods = {"pd-decode-a": {}, "pd-decode-b": {}, "pd-decode-c": {}}
    state = ApiState({"pd-prefill": 2, "pd-decode": 3}, annotations=pods)
    handler = type("Handler", (StandIn,), {"state": state})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    # A short poll interval: shutdown() waits for one.
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    state.port = server.server_address[1]  # type: ignore[attr-defined]
    yield state
    server.shutdown()
    server.server_close()


def connector(api: ApiState) -> KubernetesConnector:
    config = Configuration(host=f"http://127.0.0.1:{api.port}")  # type: ignore[attr-defined]
    client = ApiClient(config)
    loads = {"decode": {"pd-decode-a": 7.0, "pd-decode-b": 0.0, "pd-decode-c": 2.0}}
    return KubernetesConnector(AppsV1Api(client), CoreV1Api(client), NAMESPACE,
                               {"prefill": "pd-prefill", "decode": "pd-decode"},
                               lambda pool: loads.get(pool, {}))  # fmt: skip


def scale_patch(version: int, replicas: int) -> tuple[str, str, str, dict]:
    body = {"metadata": {"resourceVersion": str(version)}, "spec": {"replicas": replicas}}
    return ("PATCH", SCALE.format("pd-prefill"), MERGE, body)


GET_PREFILL = ("GET", SCALE.format("pd-prefill"), None, None)


def test_replicas_read_each_scale(api):
    assert connector(api).replicas() == {"prefill": 2, "decode": 3}
    assert [(m, p) for m, p, _, _ in api.requests] == [
        ("GET", SCALE.format("pd-prefill")), ("GET", SCALE.format("pd-decode"))]  # fmt: skip


def test_scale_up_patches_with_the_version_read(api):
    connector(api).set_replicas("prefill", 4)
    assert api.requests == [GET_PREFILL, scale_patch(100, 4)]
    assert api.replicas["pd-prefill"] == 4


def test_scale_down_marks_the_least_loaded_pods_first(api):
    connector(api).set_replicas("decode", 1)
    mark = {"metadata": {"annotations": {DELETION_COST: "-1000"}}}
    assert api.requests == [
        ("GET", SCALE.format("pd-decode"), None, None),
        ("PATCH", POD.format("pd-decode-b"), MERGE, mark),  # load 0
        ("PATCH", POD.format("pd-decode-c"), MERGE, mark),  # load 2; a (7) stays unmarked
        ("PATCH", SCALE.format("pd-decode"), MERGE,
         {"metadata": {"resourceVersion": "100"}, "spec": {"replicas": 1}}),
    ]  # fmt: skip
    assert api.annotations["pd-decode-a"] == {}
    assert api.replicas["pd-decode"] == 1


def test_a_conflict_is_read_again_and_retried(api):
    api.interleaved_writes = 1  # someone else scaled between our read and our write
    connector(api).set_replicas("prefill", 4)
    assert api.requests == [GET_PREFILL, scale_patch(100, 4), GET_PREFILL, scale_patch(101, 4)]
    assert api.replicas["pd-prefill"] == 4


def test_conflicts_in_a_row_give_up_with_the_numbers(api):
    api.interleaved_writes = 3
    with pytest.raises(ScaleError, match="serving/pd-prefill: 3 conflicting writes in a row"):
        connector(api).set_replicas("prefill", 4)
    assert len(api.requests) == 6 and api.replicas["pd-prefill"] == 2


def test_forbidden_is_not_retried_and_names_the_role(api):
    api.forbidden.add(("PATCH", SCALE.format("pd-prefill")))
    with pytest.raises(
        ScaleError,
        match="scale deployment pd-prefill in namespace serving: "
        "HTTP 403 Forbidden \\(the planner's Role needs it\\)",
    ):
        connector(api).set_replicas("prefill", 4)
    assert api.requests == [GET_PREFILL, scale_patch(100, 4)]
