"""A client that goes away mid-stream cancels its request downstream: the decode worker stops
generating and frees the request's KV blocks, and the router releases its holds.

Every request here asks for ignore_eos and (nearly) the whole context, and the client goes away
as soon as it sees the request decoding: minutes of tokens on any host, so it can only end early
by being cancelled, whatever the machine's speed."""

from __future__ import annotations

import json
import socket
from urllib.parse import urlsplit

import grpc
import httpx
import pytest
from router_harness import (
    MODEL,
    assert_cancelled_downstream,
    routed_decode_requests,
    wait_for_decode_load,
)

from pdserve.registry import Registry
from pdserve.v1 import generation_pb2 as pb
from pdserve.v1 import generation_pb2_grpc

# The prompts are a few tokens: this leaves them room under the context length.
PROMPT_ROOM = 64


@pytest.fixture(scope="module")
def max_tokens(cluster) -> int:
    """The largest output the cluster takes for these prompts: the decode worker's context."""
    (decode,) = Registry(cluster.redis_url).workers("decode")
    assert decode.max_model_len > 4000 + PROMPT_ROOM  # what these tests have always asked for
    return decode.max_model_len - PROMPT_ROOM


def test_http_stream_disconnect_cancels_the_decode_request(cluster, max_tokens):
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": max_tokens,
            "ignore_eos": True, "stream": True}  # fmt: skip
    with httpx.stream("POST", f"{cluster.http_url}/v1/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()  # held: closing this iterator would close the response
        assert next(lines).startswith('data: {"id": "cmpl-')
        assert wait_for_decode_load(cluster, running=1).free_blocks < 1024
        assert routed_decode_requests(cluster) == 1
    assert_cancelled_downstream(cluster)


def test_grpc_cancel_cancels_the_decode_request(cluster, max_tokens):
    stub = generation_pb2_grpc.GenerationStub(grpc.insecure_channel(cluster.grpc_address))
    params = pb.SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    call = stub.Generate(pb.GenerateRequest(text="Once upon a time", params=params), timeout=600)
    assert next(call).token_ids
    wait_for_decode_load(cluster, running=1)
    call.cancel()
    assert_cancelled_downstream(cluster)


def test_non_streaming_client_that_gives_up_cancels_the_decode_request(cluster, max_tokens):
    """The client sends the request on a plain socket, waits until it is decoding, checks that
    nothing came back (a non-streaming reply comes whole, at the end), and closes the socket."""
    body = json.dumps({"model": MODEL, "prompt": "Once upon a time", "max_tokens": max_tokens,
                       "ignore_eos": True}).encode()  # fmt: skip
    url = urlsplit(cluster.http_url)
    request = (
        f"POST /v1/completions HTTP/1.1\r\nHost: {url.netloc}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode() + body
    with socket.create_connection((url.hostname, url.port), timeout=60) as client:
        client.sendall(request)
        wait_for_decode_load(cluster, running=1)
        assert routed_decode_requests(cluster) == 1
        client.setblocking(False)
        with pytest.raises(BlockingIOError):  # no byte of a reply: the completion is not back
            client.recv(1)
    # the client gives up: the connection is closed
    assert_cancelled_downstream(cluster)


def test_http_stream_disconnect_cancels_every_sample(cluster, max_tokens):
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": max_tokens,
            "ignore_eos": True, "stream": True, "n": 3}  # fmt: skip
    with httpx.stream("POST", f"{cluster.http_url}/v1/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        assert next(lines).startswith('data: {"id": "cmpl-')
        assert wait_for_decode_load(cluster, running=3).free_blocks < 1024  # all three decode
        assert routed_decode_requests(cluster) == 3  # the router counts sequences
    assert_cancelled_downstream(cluster)
