"""Failures: a prefill worker killed mid-prefill, a cancelled client, a draining worker."""

from __future__ import annotations

import threading

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from pdserve.registry import worker_key
from pdserve.v1 import generation_pb2 as pb
from pdserve.worker.v1 import worker_pb2 as wpb
from pdserve.worker.v1 import worker_pb2_grpc
from tests.cluster import Cluster
from tests.waiting import wait_until
from tests.workers.calls import LONG, generate, token_ids


@pytest.fixture
def tcp_cluster():
    cluster = Cluster(kv_backend="tcp")
    yield cluster
    cluster.stop()


class Killer(threading.Thread):
    """SIGKILLs the worker mid-transfer: once a first chunk's KV has landed on the decode worker
    (the prefill worker counts its bytes sent) while its engine still holds the prompt's tokens.
    join() re-raises a failure to see that state, so the test cannot pass on a late kill."""

    def __init__(self, worker) -> None:
        super().__init__(name=f"kill-{worker.worker_id}")
        self.worker, self.failure = worker, None

    def mid_transfer(self) -> bool:
        sent = self.worker.metric(
            "pdserve_kv_transfer_bytes_total", backend="tcp", direction="sent"
        )
        return sent > 0 and self.worker.metric("pdserve_prefill_queued_tokens") > 0

    def run(self) -> None:
        try:
            wait_until(
                self.mid_transfer,
                timeout_s=120,
                message=f"{self.worker.worker_id} never seen mid-transfer",
            )
        except BaseException as e:  # noqa: BLE001 - handed to the test's thread by join()
            self.failure = e
        finally:
            self.worker.kill()  # even on a failure: the test's request must not hang on it

    def join(self, timeout: float | None = None) -> None:
        super().join(timeout)
        if self.failure is not None:
            raise self.failure


def kill_when_prefilling(worker) -> Killer:
    killer = Killer(worker)
    killer.start()
    return killer


def test_a_killed_prefill_worker_is_retried_on_another(tcp_cluster, llm):
    doomed = tcp_cluster.start("prefill", wait=False)
    tcp_cluster.start("prefill", wait=False)
    decode = tcp_cluster.start("decode", wait=False)
    tcp_cluster.wait_all_registered()
    killer = kill_when_prefilling(doomed)
    messages = generate(decode.address, LONG, doomed.address, max_tokens=4, temperature=0.0)
    killer.join()
    assert doomed.process.returncode == -9
    reference = llm.generate([LONG], _greedy(4))[0].token_ids
    assert token_ids(messages) == reference
    load = tcp_cluster.load(decode)
    assert load.free_blocks == load.total_blocks


def test_with_no_other_prefill_worker_the_client_gets_unavailable(tcp_cluster):
    doomed = tcp_cluster.start("prefill", wait=False)
    decode = tcp_cluster.start("decode", wait=False)
    tcp_cluster.wait_all_registered()
    killer = kill_when_prefilling(doomed)
    with pytest.raises(grpc.RpcError) as failure:
        generate(decode.address, LONG, doomed.address, max_tokens=4, temperature=0.0)
    killer.join()
    assert failure.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "prefill failed on every worker tried" in failure.value.details()
    load = tcp_cluster.load(decode)
    assert load.free_blocks == load.total_blocks


def test_a_cancelled_stream_frees_the_decode_workers_blocks(tcp_cluster, llm):
    prefill = tcp_cluster.start("prefill", wait=False)
    decode = tcp_cluster.start("decode", wait=False)
    tcp_cluster.wait_all_registered()
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
        lambda: tcp_cluster.load(decode).free_blocks == tcp_cluster.load(decode).total_blocks,
        timeout_s=60,
        message=lambda: f"the decode worker kept blocks: {tcp_cluster.load(decode)}",
    )
    assert tcp_cluster.load(decode).running_requests == 0


def test_sigterm_drains(tcp_cluster):
    prefill = tcp_cluster.start("prefill", wait=False)
    decode = tcp_cluster.start("decode", "--drain-grace-s", "60", wait=False)
    tcp_cluster.wait_all_registered()
    stub = worker_pb2_grpc.DecodeStub(grpc.insecure_channel(decode.address))
    request = wpb.DecodeRequest(
        prompt_token_ids=[100, 200, 300, 400],
        params=pb.SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True),
        prefill_address=prefill.address,
    )
    stream = stub.Generate(request)
    first = next(stream)
    decode.terminate()
    wait_until(
        lambda: not [w for w in tcp_cluster.registry.workers("decode")],
        timeout_s=60,
        message="the draining decode worker never left the registry",
    )
    with pytest.raises(grpc.RpcError) as refused:
        list(stub.Generate(request, timeout=30))
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
    rest = list(stream)  # the in-flight stream still completes
    assert len(first.token_ids) + sum(len(m.token_ids) for m in rest) == 60
    assert rest[-1].finish_reason == "length"
    assert decode.process.wait(timeout=60) == 0


def test_health_and_reflection_answer_and_a_killed_worker_expires(tcp_cluster):
    prefill = tcp_cluster.start("prefill", wait=False)
    decode = tcp_cluster.start("decode", wait=False)
    tcp_cluster.wait_all_registered()
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
    # Nothing removes a killed worker's entry: it must carry a TTL of at most registry_ttl_s
    # (-2: already expired) and Redis must then drop it on its own.
    remaining_ms = tcp_cluster.registry.redis.pttl(worker_key("prefill", prefill.worker_id))
    assert remaining_ms == -2 or 0 < remaining_ms <= tcp_cluster.registry_ttl_s * 1000
    wait_until(
        lambda: not tcp_cluster.registry.workers("prefill"),
        timeout_s=30,
        message=lambda: (
            f"the killed worker's entry stayed: {tcp_cluster.registry.workers('prefill')}"
        ),
    )
    assert [w.worker_id for w in tcp_cluster.registry.workers("decode")] == [decode.worker_id]


def _greedy(max_tokens: int):
    from engine import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
