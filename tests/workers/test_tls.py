"""mTLS between workers: decode -> prefill and client -> decode need a certificate from the CA."""

from __future__ import annotations

import grpc
import pytest

from pdserve.tls import channel_credentials
from pdserve.v1 import generation_pb2 as pb
from pdserve.worker.v1 import worker_pb2 as wpb
from pdserve.worker.v1 import worker_pb2_grpc
from tests.certs import make_pki
from tests.cluster import Cluster


def test_workers_talk_mtls_and_refuse_clients_without_a_certificate(tmp_path):
    pki = make_pki(tmp_path)
    tls_args = ["--tls-cert-file", pki.server.cert_file, "--tls-key-file", pki.server.key_file,
                "--tls-ca-file", pki.ca_file]  # fmt: skip
    cluster = Cluster(kv_backend="tcp", extra_args=tls_args)
    try:
        prefill = cluster.start("prefill", wait=False)
        decode = cluster.start("decode", wait=False)
        cluster.wait_all_registered()
        request = wpb.DecodeRequest(
            prompt_token_ids=[100, 200, 300],
            params=pb.SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True),
            prefill_address=prefill.address,
        )
        secure = grpc.secure_channel(decode.address, channel_credentials(pki.client))
        messages = list(worker_pb2_grpc.DecodeStub(secure).Generate(request, timeout=120))
        assert sum(len(m.token_ids) for m in messages) == 3  # decode reached prefill over mTLS

        anonymous = channel_credentials(type(pki.client)(ca_file=pki.ca_file))  # no client cert
        for channel in (grpc.insecure_channel(decode.address),
                        grpc.secure_channel(decode.address, anonymous)):  # fmt: skip
            with pytest.raises(grpc.RpcError) as refused:
                list(worker_pb2_grpc.DecodeStub(channel).Generate(request, timeout=10))
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        cluster.stop()
