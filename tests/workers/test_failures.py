"""Failures: a prefill worker killed mid-prefill, a cancelled client, a draining worker."""

from __future__ import annotations

import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from pdserve.v1 import generation_pb2 as pb
from pdserve.worker.v1 import worker_pb2 as wpb
from pdserve.worker.v1 import worker_pb2_grpc
from tests.cluster import Cluster
from tests.workers.conftest import generate, token_ids

LONG = [(13 * i) % 5000 + 200 for i in range(3000)]  # several seconds of prefill on 1 thread


@pytest.fixture
def tcp_cluster():
    cluster = Cluster(kv_backend="tcp")
    yield cluster
    cluster.stop()


def wait_until(predicate, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.05)


def kill_when_prefilling(worker) -> threading.Thread:
    """SIGKILLs the worker as soon as its engine holds queued prompt tokens."""

    def run():
        wait_until(lambda: worker.metric("pdserve_prefill_queued_tokens") > 0)
        time.sleep(0.3)  # a chunk or so in: KV has started to move
        worker.kill()

    thread = threading.Thread(target=run)
    thread.start()
    return thread


def test_a_killed_prefill_worker_is_retried_on_another(tcp_cluster, llm):
    doomed = tcp_cluster.start("prefill")
    tcp_cluster.start("prefill")
    decode = tcp_cluster.start("decode")
    killer = kill_when_prefilling(doomed)
    messages = generate(decode.address, LONG, doomed.address, max_tokens=4, temperature=0.0)
    killer.join()
    assert doomed.process.returncode == -9
    reference = llm.generate([LONG], _greedy(4))[0].token_ids
    assert token_ids(messages) == reference
    load = tcp_cluster.load(decode)
    assert load.free_blocks == load.total_blocks


def test_with_no_other_prefill_worker_the_client_gets_unavailable(tcp_cluster):
    doomed = tcp_cluster.start("prefill")
    decode = tcp_cluster.start("decode")
    killer = kill_when_prefilling(doomed)
    with pytest.raises(grpc.RpcError) as failure:
        generate(decode.address, LONG, doomed.address, max_tokens=4, temperature=0.0)
    killer.join()
    assert failure.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "prefill failed on every worker tried" in failure.value.details()
    load = tcp_cluster.load(decode)
    assert load.free_blocks == load.total_blocks


def test_a_cancelled_stream_frees_the_decode_workers_blocks(tcp_cluster, llm):
    prefill = tcp_cluster.start("prefill")
    decode = tcp_cluster.start("decode")
    stub = worker_pb2_grpc.DecodeStub(grpc.insecure_channel(decode.address))
    request = wpb.DecodeRequest(
        prompt_token_ids=llm.tokenizer.encode("Tell me a very long story."),
        params=pb.SamplingParams(max_tokens=2000, temperature=0.0, ignore_eos=True),
        prefill_address=prefill.address,
    )
    stream = stub.Generate(request)
    for i, _ in enumerate(stream):
        if i == 3:
            break
    stream.cancel()
    wait_until(
        lambda: tcp_cluster.load(decode).free_blocks == tcp_cluster.load(decode).total_blocks
    )
    assert tcp_cluster.load(decode).running_requests == 0


def test_sigterm_drains(tcp_cluster):
    prefill = tcp_cluster.start("prefill")
    decode = tcp_cluster.start("decode", "--drain-grace-s", "60")
    stub = worker_pb2_grpc.DecodeStub(grpc.insecure_channel(decode.address))
    request = wpb.DecodeRequest(
        prompt_token_ids=[100, 200, 300, 400],
        params=pb.SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True),
        prefill_address=prefill.address,
    )
    stream = stub.Generate(request)
    first = next(stream)
    decode.terminate()
    wait_until(lambda: not [w for w in tcp_cluster.registry.workers("decode")])
    with pytest.raises(grpc.RpcError) as refused:
        list(stub.Generate(request, timeout=30))
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
    rest = list(stream)  # the in-flight stream still completes
    assert len(first.token_ids) + sum(len(m.token_ids) for m in rest) == 60
    assert rest[-1].finish_reason == "length"
    assert decode.process.wait(timeout=60) == 0


def test_health_and_reflection_answer_and_a_killed_worker_expires(tcp_cluster):
    prefill = tcp_cluster.start("prefill")
    decode = tcp_cluster.start("decode")
    for worker, service in ((prefill, "pdserve.worker.v1.Prefill"),
                            (decode, "pdserve.worker.v1.Decode")):  # fmt: skip
        channel = grpc.insecure_channel(worker.address)
        health = health_pb2_grpc.HealthStub(channel)
        for name in ("", service):
            status = health.Check(health_pb2.HealthCheckRequest(service=name), timeout=10).status
            assert status == health_pb2.HealthCheckResponse.SERVING
        reflect = reflection_pb2_grpc.ServerReflectionStub(channel)
        [answer] = reflect.ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=10
        )
        names = {s.name for s in answer.list_services_response.service}
        assert {service, "grpc.health.v1.Health"} <= names
    prefill.kill()
    killed_at = time.monotonic()
    wait_until(lambda: not tcp_cluster.registry.workers("prefill"), timeout_s=10)
    assert time.monotonic() - killed_at <= tcp_cluster.registry_ttl_s + 1.0
    assert [w.worker_id for w in tcp_cluster.registry.workers("decode")] == [decode.worker_id]


def _greedy(max_tokens: int):
    from engine import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
