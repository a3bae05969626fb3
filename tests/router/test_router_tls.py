"""TLS end to end: clients reach the router over HTTPS and gRPC with mutual TLS, and the
router reaches mTLS-only decode workers with its own client certificate."""

from __future__ import annotations

import ssl

import grpc
import httpx
import pytest
from router_harness import MODEL, InProcessRouter

from pdserve.launcher import ClusterSpec, LocalCluster
from pdserve.tls import channel_credentials
from pdserve.v1 import generation_pb2 as pb
from pdserve.v1 import generation_pb2_grpc
from router.settings import RouterSettings
from tests.certs import make_pki


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def tls_router(pki, tmp_path_factory):
    server = pki.server
    worker_tls = ("--tls-cert-file", server.cert_file, "--tls-key-file", server.key_file,
                  "--tls-ca-file", pki.ca_file)  # fmt: skip
    logs = tmp_path_factory.mktemp("tls-logs")
    spec = ClusterSpec(kv_backend="tcp", warmup=False, num_cores=2, with_router=False,
                       worker_args=worker_tls, log_dir=logs)  # fmt: skip
    cluster = LocalCluster(spec).start()
    settings = RouterSettings(redis_url=cluster.redis_url, http_port=0, grpc_port=0,
                              tls=server, worker_tls=pki.client)  # fmt: skip
    router = InProcessRouter(settings)
    yield router
    router.stop()
    cluster.stop()


def https_client(pki, with_certificate: bool) -> httpx.Client:
    context = ssl.create_default_context(cafile=pki.ca_file)
    if with_certificate:
        context.load_cert_chain(pki.client.cert_file, pki.client.key_file)
    return httpx.Client(verify=context, timeout=120)


def test_https_with_client_certificate_reaches_mtls_workers(pki, tls_router):
    url = f"https://127.0.0.1:{tls_router.server.http_port}/v1/completions"
    body = {"model": MODEL, "prompt": "1, 2, 3,", "max_tokens": 4, "temperature": 0,
            "ignore_eos": True}  # fmt: skip
    with https_client(pki, with_certificate=True) as client:
        response = client.post(url, json=body)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 4
    with https_client(pki, with_certificate=False) as client, pytest.raises(httpx.HTTPError):
        client.post(url, json=body)  # the router requires a client certificate


def test_grpc_over_mtls(pki, tls_router):
    request = pb.GenerateRequest(text="1, 2, 3,", params=pb.SamplingParams(
        max_tokens=4, temperature=0, ignore_eos=True))  # fmt: skip
    secure = grpc.secure_channel(tls_router.grpc_address, channel_credentials(pki.client))
    response = generation_pb2_grpc.GenerationStub(secure).Complete(request, timeout=120)
    assert len(response.token_ids) == 4
    with pytest.raises(grpc.RpcError) as refused:
        generation_pb2_grpc.GenerationStub(grpc.insecure_channel(tls_router.grpc_address)
                                           ).Complete(request, timeout=10)  # fmt: skip
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
