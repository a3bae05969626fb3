"""Faults under the router, over real processes (Redis, one prefill and two decode workers):
a stopped decode or prefill worker ends the request at its deadline with a clean error, never
a hang; a decode worker killed mid-stream loses no request: each moves to the other decode
worker and finishes with exactly the tokens an uninterrupted run gives."""

from __future__ import annotations

import json
import signal
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import grpc
import httpx
import pytest
from router_harness import MODEL, InProcessRouter, one_torch_thread, pool_of, spanning_stop, worker

from engine import SamplingParams
from engine.stop import OutputText
from engine.tokenizer import IncrementalDetokenizer
from pdserve.v1 import generation_pb2 as pb
from pdserve.v1 import generation_pb2_grpc
from router import metrics
from router.gateway import Gateway
from router.settings import RouterSettings
from tests.cluster import Cluster, WorkerProcess

DEADLINE_S = 3.0
MAX_TOKENS = 32
PROMPTS = [
    "The capital of France is",
    "def add(a, b):\n    return",
    "Once upon a time, in a small village,",
    "The three primary colours are",
    "Water boils at a temperature of",
    "Translate to French: good morning, my friend.",
    "A list of prime numbers: 2, 3, 5,",
    "The quick brown fox",
]


@pytest.fixture(scope="module")
def workers() -> Iterator[Cluster]:
    # A long registry TTL keeps a stopped worker listed while a test talks to it.
    started = Cluster(kv_backend="tcp", registry_ttl_s=20.0)
    try:
        for role in ("prefill", "decode", "decode"):
            started.start(role, wait=False)
        started.wait_all_registered()
        yield started
    finally:
        started.stop()


def router_for(cluster: Cluster, **settings: object) -> InProcessRouter:
    return InProcessRouter(RouterSettings(redis_url=cluster.redis.url, http_port=0, grpc_port=0,
                                          **settings))  # type: ignore[arg-type]  # fmt: skip


@pytest.fixture(scope="module")
def deadline_router(workers) -> Iterator[InProcessRouter]:
    router = router_for(workers, request_timeout_s=DEADLINE_S)
    yield router
    router.stop()


def of_role(cluster: Cluster, role: str) -> list[WorkerProcess]:
    return [w for w in cluster.workers if w.role == role and w.process.poll() is None]


def completion(router: InProcessRouter, max_tokens: int = 2) -> httpx.Response:
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": max_tokens, "temperature": 0}
    return httpx.post(f"{router.http_url}/v1/completions", json=body, timeout=120)


def wait_until_idle(cluster: Cluster, timeout_s: float = 120.0) -> None:
    """Every decode worker's KV blocks free again, by a heartbeat sent after this call."""
    since, deadline = time.time(), time.monotonic() + timeout_s
    while True:
        infos = {w.worker_id: w for w in cluster.registry.workers("decode")}
        fresh = [infos.get(w.worker_id) for w in of_role(cluster, "decode")]
        if all(i is not None and i.updated_at > since for i in fresh) and all(
            i.load.free_blocks == i.load.total_blocks and i.load.running_requests == 0
            for i in fresh
        ):
            return
        assert time.monotonic() < deadline, [i.load if i else None for i in fresh]
        time.sleep(0.2)


def assert_deadline_errors(router: InProcessRouter) -> None:
    response = completion(router)
    assert response.status_code == 504, response.text
    error = response.json()["error"]
    assert (error["type"], error["param"], error["code"]) == ("timeout_error", None, "timeout")
    assert error["message"].startswith("the request's deadline passed"), error["message"]
    stub = generation_pb2_grpc.GenerationStub(grpc.insecure_channel(router.grpc_address))
    request = pb.GenerateRequest(text="Hello", params=pb.SamplingParams(max_tokens=2))
    with pytest.raises(grpc.RpcError) as raised:
        stub.Complete(request, timeout=120)  # the router's deadline is far sooner
    assert raised.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED


@pytest.mark.parametrize("role", ["decode", "prefill"])
def test_a_stopped_worker_ends_the_request_at_its_deadline(workers, deadline_router, role):
    stopped = of_role(workers, role)  # every worker of the role: no other can serve it
    for w in stopped:
        w.process.send_signal(signal.SIGSTOP)
    try:
        assert_deadline_errors(deadline_router)
    finally:
        for w in stopped:
            w.process.send_signal(signal.SIGCONT)
    assert completion(deadline_router).status_code == 200  # and it serves again
    wait_until_idle(workers)


def test_the_deadline_is_the_sooner_of_the_timeout_and_the_clients_own():
    settings = RouterSettings(redis_url="", request_timeout_s=600.0)
    pool = pool_of(worker("prefill", "p"), worker("decode", "d"))
    gateway = Gateway(settings, None, pool, None, None)  # type: ignore[arg-type]
    params = lambda room: SamplingParams(max_tokens=4)  # noqa: E731
    assert gateway.job([1, 2, 3], params, 100.0).deadline_s == 700.0
    assert gateway.job([1, 2, 3], params, 100.0, client_timeout_s=2.5).deadline_s == 102.5
    assert gateway.job([1, 2, 3], params, 100.0, client_timeout_s=900.0).deadline_s == 700.0


def reference_pieces(tokenizer, token_ids: list[int]) -> list[str]:
    """Each token's text as a stream without stop strings carries it."""
    output, params = OutputText(IncrementalDetokenizer(tokenizer)), SamplingParams()
    pieces = []
    for token_id in token_ids:
        output.add(token_id, params, tokenizer.eos_token_id)
        pieces.append(output.release(params, finished=False))
    return pieces


def test_a_decode_worker_killed_mid_stream_loses_no_request(workers, llm):
    greedy = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    with one_torch_thread():
        want = llm.generate(PROMPTS, greedy)
    # Two streams also stop at a string late in the text (spanning 3 tokens): text held back
    # for it may be in flight when the worker dies.
    stops = {i: spanning_stop(reference_pieces(llm.tokenizer, want[i].token_ids), 3, 26)
             for i in (2, 5)}  # fmt: skip
    router = router_for(workers, max_migrations=1)
    stub = generation_pb2_grpc.GenerationStub(grpc.insecure_channel(router.grpc_address))
    progress = [0] * len(PROMPTS)
    lock = threading.Lock()

    def stream(i: int) -> list[pb.GenerateResponse]:
        stop = [stops[i][0]] if i in stops else []
        params = pb.SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True,
                                   stop=stop)  # fmt: skip
        messages = []
        for message in stub.Generate(pb.GenerateRequest(text=PROMPTS[i], params=params),
                                     timeout=300):  # fmt: skip
            messages.append(message)
            with lock:
                progress[i] += len(message.token_ids)
        return messages

    try:
        with ThreadPoolExecutor(len(PROMPTS)) as threads:
            futures = [threads.submit(stream, i) for i in range(len(PROMPTS))]
            deadline = time.monotonic() + 240
            while min(progress) < 2:
                assert not any(f.done() for f in futures), [f.exception() for f in futures]
                assert time.monotonic() < deadline, progress
                time.sleep(0.02)
            victim, num_on_victim = busiest_decode_worker(workers, router)
            before = metrics.MIGRATIONS.labels(victim.worker_id)._value.get()
            victim.kill()
            with lock:  # every stream was unfinished when the worker died
                assert max(progress) <= MAX_TOKENS - 6, progress
            results = [f.result(timeout=300) for f in futures]
        for i, (messages, expected) in enumerate(zip(results, want, strict=True)):
            token_ids = [t for m in messages for t in m.token_ids]
            text = "".join(m.text for m in messages)
            final = messages[-1]
            if i in stops:
                stop, start, last = stops[i]
                assert token_ids == expected.token_ids[: last + 1], i
                assert text == expected.text[:start], i
                assert (final.finish_reason, final.stop_str) == ("stop", stop), i
            else:
                assert token_ids == expected.token_ids, i
                assert text == expected.text, i
                assert final.finish_reason == "length", i
            assert final.usage.prompt_tokens == len(expected.prompt_token_ids), i
            assert final.usage.completion_tokens == len(token_ids), i
        after = metrics.MIGRATIONS.labels(victim.worker_id)._value.get()
        assert after - before == num_on_victim >= 1
        metrics_text = httpx.get(f"{router.http_url}/metrics", timeout=10).text
        assert f'pdserve_router_migrations_total{{decode_worker="{victim.worker_id}"}}' in (
            metrics_text
        )
        wait_until_idle(workers)
    finally:
        router.stop()


def busiest_decode_worker(cluster: Cluster, router: InProcessRouter) -> tuple[WorkerProcess, int]:
    """The decode worker with the most of this router's requests in flight, and how many."""
    views = httpx.get(f"{router.http_url}/admin/workers", timeout=10).json()["workers"]
    counts = {v["worker_id"]: v["assigned_here"]["requests"] for v in views
              if v["role"] == "decode"}  # fmt: skip
    assert sum(counts.values()) == len(PROMPTS), json.dumps(counts)
    worker_id = max(sorted(counts), key=counts.__getitem__)
    (victim,) = [w for w in cluster.workers if w.worker_id == worker_id]
    return victim, counts[worker_id]


def test_a_request_with_n_samples_is_not_moved_when_its_decode_worker_dies(workers):
    """Runs last: it kills one of two decode workers (it starts one if an earlier test left
    only one). A move resumes one token sequence, so n samples end with the error instead."""
    if len(of_role(workers, "decode")) < 2:
        workers.start("decode")
    router = router_for(workers, max_migrations=1)
    stub = generation_pb2_grpc.GenerationStub(grpc.insecure_channel(router.grpc_address))
    params = pb.SamplingParams(max_tokens=4000, ignore_eos=True, n=2)
    try:
        call = stub.Generate(pb.GenerateRequest(text="Once upon a time", params=params),
                             timeout=300)  # fmt: skip
        assert next(call).token_ids
        views = httpx.get(f"{router.http_url}/admin/workers", timeout=10).json()["workers"]
        # The router counts the two samples as two sequences on their worker.
        (worker_id,) = [v["worker_id"] for v in views if v["role"] == "decode"
                        and v["assigned_here"]["requests"] == 2]  # fmt: skip
        (victim,) = [w for w in of_role(workers, "decode") if w.worker_id == worker_id]
        before = metrics.MIGRATIONS.labels(victim.worker_id)._value.get()
        victim.kill()
        with pytest.raises(grpc.RpcError) as lost:
            list(call)
        assert lost.value.code() == grpc.StatusCode.UNAVAILABLE
        assert lost.value.details().startswith(f"decode worker {victim.address} "), (
            lost.value.details()
        )
        assert metrics.MIGRATIONS.labels(victim.worker_id)._value.get() == before
        wait_until_idle(workers)
    finally:
        router.stop()
