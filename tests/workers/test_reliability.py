"""Worker reliability: cancels during remote prefill, engine death, stalled prefill workers,
limits. Every test runs real worker processes and ends with every KV block free."""

from __future__ import annotations

import random
import signal
import sys
import threading

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdserve.v1 import generation_pb2 as pb
from pdserve.worker.v1 import worker_pb2 as wpb
from pdserve.worker.v1 import worker_pb2_grpc
from tests.cluster import Cluster
from tests.waiting import wait_until
from tests.workers.calls import LONG, token_ids
from tests.workers.faulty_worker import POISON

FAULTY = (sys.executable, "-m", "tests.workers.faulty_worker")
SHORT_PROMPTS = [[100 + i, 200 + i, 300 + i, 400 + i, 500 + i] for i in range(3)]


def decode_request(prompt, prefill, max_tokens=8, **params) -> wpb.DecodeRequest:
    return wpb.DecodeRequest(
        prompt_token_ids=prompt,
        params=pb.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **params),
        prefill_address=prefill.address,
    )


def stub_of(worker) -> worker_pb2_grpc.DecodeStub:
    return worker_pb2_grpc.DecodeStub(grpc.insecure_channel(worker.address))


@pytest.mark.parametrize("backend", ["tcp", "nixl"])
def test_cancels_during_remote_prefill_never_corrupt_other_requests(backend, llm):
    """Clients give up at random moments of their long prompts' prefill (16 per backend, 32 in
    all) while short greedy requests run beside them: those come out exactly as from the
    engine alone, and once idle both workers' pools are whole (the engine checks its pool's
    integrity on going idle, and dies on a fault)."""
    cluster = Cluster(kv_backend=backend)
    try:
        prefill = cluster.start("prefill", "--chunk-size", "256", wait=False)
        # A generous budget: on a loaded 2-core machine the bystanders queue behind the storm.
        decode = cluster.start("decode", "--prefill-timeout-s", "600", wait=False)
        cluster.wait_all_registered()
        stub = stub_of(decode)
        rng = random.Random(7)
        num_cancelled = 0

        def cancel_at_random(i: int) -> None:
            nonlocal num_cancelled
            prompt = LONG[i * 17 : i * 17 + 400 + 40 * (i % 5)]
            call = stub.Generate(decode_request(prompt, prefill, max_tokens=4), timeout=300)
            threading.Timer(rng.uniform(0.0, 1.5), call.cancel).start()
            try:
                list(call)
            except grpc.RpcError as e:
                assert e.code() == grpc.StatusCode.CANCELLED, e
                num_cancelled += 1

        expected = [o.token_ids for o in llm.generate(SHORT_PROMPTS, _greedy(12))]
        outputs: dict[int, list[int]] = {}

        def short_requests() -> None:
            for _ in range(2):
                for j, prompt in enumerate(SHORT_PROMPTS):
                    messages = list(stub.Generate(decode_request(prompt, prefill, 12), timeout=300))
                    assert token_ids(messages) == expected[j]
                    outputs[j] = token_ids(messages)

        bystander = threading.Thread(target=short_requests)
        bystander.start()
        cancellers = [threading.Thread(target=cancel_at_random, args=(i,)) for i in range(16)]
        for batch in range(0, 16, 4):  # a few at a time: each is mid-prefill when cancelled
            for thread in cancellers[batch : batch + 4]:
                thread.start()
            for thread in cancellers[batch : batch + 4]:
                thread.join()
        bystander.join()
        assert outputs == dict(enumerate(expected))
        assert num_cancelled >= 8  # most were cancelled before their 4 tokens came out
        # The cancels reached the prefill worker, which dropped the work (not just the decode).
        assert prefill.metric("pdserve_prefill_requests_total", outcome="aborted") >= 1
        cluster.assert_idle(decode, prefill)
    finally:
        cluster.stop()


def test_engine_death_fails_every_request_and_exits_non_zero(tcp_cluster):
    prefill = tcp_cluster.start("prefill", wait=False)
    decode = tcp_cluster.start("decode", program=FAULTY, wait=False)
    tcp_cluster.wait_all_registered()
    channel = grpc.insecure_channel(decode.address)
    health = health_pb2_grpc.HealthStub(channel).Watch(
        health_pb2.HealthCheckRequest(service=""), timeout=300
    )
    assert next(health).status == health_pb2.HealthCheckResponse.SERVING
    stub = worker_pb2_grpc.DecodeStub(channel)
    streams = [
        stub.Generate(decode_request(p, prefill, max_tokens=2000), timeout=300)
        for p in SHORT_PROMPTS[:2]
    ]
    for stream in streams:
        next(stream)  # decoding
    poisoned = stub.Generate(decode_request(POISON + [7] * 20, prefill), timeout=300)
    for call in (*streams, poisoned):
        with pytest.raises(grpc.RpcError) as failure:
            list(call)
        assert failure.value.code() == grpc.StatusCode.INTERNAL
        assert "engine thread died: RuntimeError: injected fault" in failure.value.details()
    assert next(health).status == health_pb2.HealthCheckResponse.NOT_SERVING
    assert decode.process.wait(timeout=60) == 70
    assert [w.worker_id for w in tcp_cluster.registry.workers("decode")] == []
    assert prefill.process.poll() is None


@pytest.mark.parametrize("backend", ["tcp", "nixl"])
def test_a_stopped_prefill_worker_costs_the_request_its_deadline_not_forever(backend, llm):
    cluster = Cluster(kv_backend=backend)
    try:
        prefill = cluster.start("prefill", wait=False)
        decode = cluster.start("decode", "--prefill-timeout-s", "6", wait=False)
        cluster.wait_all_registered()
        stub = stub_of(decode)
        call = stub.Generate(decode_request(LONG[:2000], prefill, max_tokens=4), timeout=300)
        wait_until(
            lambda: prefill.metric("pdserve_prefill_queued_tokens") > 0,
            timeout_s=60,
            message="the prefill worker queued the prompt",
        )
        prefill.process.send_signal(signal.SIGSTOP)
        try:
            with pytest.raises(grpc.RpcError) as failure:
                list(call)
            assert failure.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            assert "prefill" in failure.value.details()
        finally:
            prefill.process.send_signal(signal.SIGCONT)
        # Blocks the stopped writer could still reach stay quarantined until it resumes and
        # confirms; then everything is free, and the next request is served as usual.
        cluster.assert_idle(decode, prefill)
        messages = list(stub.Generate(decode_request(SHORT_PROMPTS[0], prefill), timeout=300))
        assert token_ids(messages) == llm.generate([SHORT_PROMPTS[0]], _greedy(8))[0].token_ids
    finally:
        cluster.stop()


def test_past_max_num_seqs_and_the_rpc_limit_callers_get_resource_exhausted(tcp_cluster):
    prefill = tcp_cluster.start("prefill", wait=False)
    seq_limited = tcp_cluster.start("decode", "--max-num-seqs", "2", wait=False)
    rpc_limited = tcp_cluster.start("decode", "--max-concurrent-rpcs", "2", wait=False)
    tcp_cluster.wait_all_registered()
    expected = [
        (seq_limited, "2 requests are running or awaiting KV; max_num_seqs is 2"),
        (rpc_limited, "worker has 2 requests in flight, its limit (--max-concurrent-rpcs); "
         "retry elsewhere"),
    ]  # fmt: skip
    for decode, details in expected:
        stub = stub_of(decode)
        running = [
            stub.Generate(decode_request(p, prefill, max_tokens=2000), timeout=300)
            for p in SHORT_PROMPTS[:2]
        ]
        for stream in running:
            next(stream)  # both decoding
        with pytest.raises(grpc.RpcError) as busy:
            list(stub.Generate(decode_request(SHORT_PROMPTS[2], prefill), timeout=60))
        assert busy.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert busy.value.details() == details
        for stream in running:
            stream.cancel()
        tcp_cluster.assert_idle(decode)
        # Capacity is back: the refused request is served now.
        assert len(token_ids(list(stub.Generate(decode_request(SHORT_PROMPTS[2], prefill))))) == 8
    tcp_cluster.assert_idle(prefill)


def _greedy(max_tokens: int):
    from engine import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


@pytest.fixture
def tcp_cluster():
    cluster = Cluster(kv_backend="tcp")
    yield cluster
    cluster.stop()
