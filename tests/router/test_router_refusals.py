"""A decode worker past its limits refuses a request before doing anything with it: the router
sends it to another decode worker (a 429 comes only when every one refuses). The router keeps
requests past the limits a worker publishes in its queue, so a refusal is what it could not
foresee: here, streams sent straight to the worker between two of its heartbeats."""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import httpx
import pytest
from router_harness import MODEL, InProcessRouter

from pdserve.v1 import generation_pb2 as pb
from pdserve.worker.v1 import worker_pb2 as wpb
from pdserve.worker.v1 import worker_pb2_grpc
from router.settings import RouterSettings
from tests.cluster import Cluster, WorkerProcess


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    # Heartbeats 10 minutes apart: the router knows the workers only as they registered, idle.
    started = Cluster(kv_backend="tcp", registry_ttl_s=1800.0)
    try:
        started.start("prefill", wait=False)
        started.start("decode", "--max-num-seqs", "1", wait=False)  # decode-1: tiny
        started.start("decode", wait=False)  # decode-2
        started.wait_all_registered()
        yield started
    finally:
        started.stop()


def occupy(cluster: Cluster, decode: WorkerProcess, num_streams: int) -> list:
    """Long greedy streams straight to one decode worker, each decoding once returned."""
    [prefill] = [w for w in cluster.workers if w.role == "prefill"]
    stub = worker_pb2_grpc.DecodeStub(grpc.insecure_channel(decode.address))
    streams = []
    for i in range(num_streams):
        request = wpb.DecodeRequest(
            prompt_token_ids=[300 + i, 301, 302, 303],
            params=pb.SamplingParams(max_tokens=5000, temperature=0.0, ignore_eos=True),
            prefill_address=prefill.address,
        )
        stream = stub.Generate(request, timeout=600)
        next(stream)
        streams.append(stream)
    return streams


def refusals(decode_worker: str) -> float:
    from prometheus_client import REGISTRY

    labels = {"decode_worker": decode_worker}
    return REGISTRY.get_sample_value("pdserve_router_decode_refusals_total", labels) or 0.0


def complete(router: InProcessRouter) -> httpx.Response:
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 3, "temperature": 0}
    return httpx.post(f"{router.http_url}/v1/completions", json=body, timeout=120)


def test_a_refused_request_goes_to_another_decode_worker(cluster):
    tiny, roomy = (w for w in cluster.workers if w.role == "decode")
    router = InProcessRouter(RouterSettings(redis_url=cluster.redis.url, http_port=0, grpc_port=0))
    streams = []
    try:
        # The tiny worker is at its limit, which the router cannot know before its next
        # heartbeat: both look idle, and the tie goes to the lower id, the tiny one.
        streams += occupy(cluster, tiny, 1)
        assert [v.running_requests for v in router.server.pool.views("decode")] == [0, 0]
        before = refusals(tiny.worker_id)
        response = complete(router)
        assert response.status_code == 200, response.text
        assert response.json()["usage"]["completion_tokens"] == 3
        assert refusals(tiny.worker_id) == before + 1
    finally:
        for stream in streams:
            stream.cancel()
        router.stop()
