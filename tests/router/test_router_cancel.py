"""A client that goes away mid-stream cancels its request downstream: the decode worker stops
generating and frees the request's KV blocks, and the router releases its holds."""

from __future__ import annotations

import time

import grpc
import httpx
from router_harness import MODEL

from pdserve.registry import Registry, WorkerLoad
from pdserve.v1 import generation_pb2 as pb
from pdserve.v1 import generation_pb2_grpc

# ~5 minutes of decoding on this machine: the request can only end early by being cancelled.
MAX_TOKENS = 4000


def wait_for_decode_load(cluster, running: int, timeout_s: float = 60.0) -> WorkerLoad:
    """The decode worker's load from a heartbeat sent after this call, once it shows `running`
    requests (registry numbers lag by up to a heartbeat: older ones prove nothing)."""
    registry, since = Registry(cluster.redis_url), time.time()
    deadline = time.monotonic() + timeout_s
    while True:
        (decode,) = registry.workers("decode")
        if decode.updated_at > since and decode.load.running_requests == running:
            return decode.load
        assert time.monotonic() < deadline, f"decode worker never showed {running} running"
        time.sleep(0.1)


def routed_decode_requests(cluster) -> int:
    workers = httpx.get(f"{cluster.http_url}/admin/workers", timeout=10).json()["workers"]
    (decode,) = [w for w in workers if w["role"] == "decode"]
    return decode["assigned_here"]["requests"]


def assert_cancelled_downstream(cluster) -> None:
    idle = wait_for_decode_load(cluster, running=0)
    assert idle.free_blocks == idle.total_blocks  # every KV block is back
    assert routed_decode_requests(cluster) == 0


def test_http_stream_disconnect_cancels_the_decode_request(cluster):
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": MAX_TOKENS,
            "ignore_eos": True, "stream": True}  # fmt: skip
    with httpx.stream("POST", f"{cluster.http_url}/v1/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()  # held: closing this iterator would close the response
        assert next(lines).startswith('data: {"id": "cmpl-')
        assert wait_for_decode_load(cluster, running=1).free_blocks < 1024
        assert routed_decode_requests(cluster) == 1
    assert_cancelled_downstream(cluster)


def test_grpc_cancel_cancels_the_decode_request(cluster):
    stub = generation_pb2_grpc.GenerationStub(grpc.insecure_channel(cluster.grpc_address))
    params = pb.SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    call = stub.Generate(pb.GenerateRequest(text="Once upon a time", params=params), timeout=600)
    assert next(call).token_ids
    wait_for_decode_load(cluster, running=1)
    call.cancel()
    assert_cancelled_downstream(cluster)


def test_non_streaming_client_that_gives_up_cancels_the_decode_request(cluster):
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": MAX_TOKENS,
            "ignore_eos": True}  # fmt: skip
    with httpx.Client(timeout=httpx.Timeout(60, read=3.0)) as client:
        try:
            client.post(f"{cluster.http_url}/v1/completions", json=body)
        except httpx.ReadTimeout:
            pass  # the client gives up and closes the connection
        else:
            raise AssertionError("a 4000-token completion cannot be back in 3 s")
    assert_cancelled_downstream(cluster)


def test_http_stream_disconnect_cancels_every_sample(cluster):
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": MAX_TOKENS,
            "ignore_eos": True, "stream": True, "n": 3}  # fmt: skip
    with httpx.stream("POST", f"{cluster.http_url}/v1/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        assert next(lines).startswith('data: {"id": "cmpl-')
        assert wait_for_decode_load(cluster, running=3).free_blocks < 1024  # all three decode
        assert routed_decode_requests(cluster) == 3  # the router counts sequences
    assert_cancelled_downstream(cluster)
