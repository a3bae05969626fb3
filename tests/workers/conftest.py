"""Fixtures: a real cluster (Redis + prefill + decode processes) per KV transfer backend."""

from __future__ import annotations

import grpc
import pytest

from pdserve.v1 import generation_pb2 as pb
from pdserve.worker.v1 import worker_pb2 as wpb
from pdserve.worker.v1 import worker_pb2_grpc
from tests.cluster import Cluster


@pytest.fixture(scope="module", params=["tcp", "nixl"])
def cluster(request):
    cluster = Cluster(kv_backend=request.param)
    try:
        cluster.start("prefill", wait=False)
        cluster.start("decode", wait=False)
        cluster.wait_all_registered()
        yield cluster
    finally:
        cluster.stop()


def generate(decode_address: str, prompt_ids: list[int], prefill_address: str = "", **params):
    """Calls Decode.Generate directly; returns the stream's messages."""
    stub = worker_pb2_grpc.DecodeStub(grpc.insecure_channel(decode_address))
    request = wpb.DecodeRequest(
        prompt_token_ids=prompt_ids,
        params=pb.SamplingParams(**params),
        prefill_address=prefill_address,
    )
    return list(stub.Generate(request, timeout=300))


def token_ids(messages) -> list[int]:
    return [t for m in messages for t in m.token_ids]
