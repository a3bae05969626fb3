"""Faults under the router, over real processes (Redis, one prefill and two decode workers):
a stopped decode or prefill worker ends the request at its deadline with a clean error, never
a hang; a decode worker killed mid-stream loses no request: each moves to the other decode
worker and finishes with exactly the tokens an uninterrupted run gives, penalties and
min_tokens counting the tokens streamed before the move."""

from __future__ import annotations

import json
import signal
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import grpc
import httpx
import pytest
from router_harness import MODEL, InProcessRouter, one_torch_thread, pool_of, spanning_stop, worker

from engine import SamplingParams
from engine.stop import OutputText
from engine.tokenizer import IncrementalDetokenizer
from pdserve import grpc_convert
from pdserve.v1 import generation_pb2 as pb
from pdserve.v1 import generation_pb2_grpc
from router import metrics
from router.gateway import Gateway
from router.settings import RouterSettings, RoutingSettings
from tests.cluster import Cluster, WorkerProcess
from tests.waiting import wait_until
from tests.workers.calls import PROMPTS

DEADLINE_S = 3.0
MAX_TOKENS = 32


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


def two_live_decode_workers(cluster: Cluster) -> None:
    """Starts one if an earlier test killed one, and unlists the killed (their keys outlive
    them by the long TTL): a request moved onto one would find it gone."""
    for w in cluster.workers:
        if w.role == "decode" and w.process.poll() is not None:
            cluster.registry.remove("decode", w.worker_id)
    if len(of_role(cluster, "decode")) < 2:
        cluster.start("decode")


def wait_until_idle(cluster: Cluster, timeout_s: float = 120.0) -> None:
    """Every decode worker's KV blocks free again, by a heartbeat sent after this call."""
    since, fresh = time.time(), []

    def idle() -> bool:
        infos = {w.worker_id: w for w in cluster.registry.workers("decode")}
        fresh[:] = [infos.get(w.worker_id) for w in of_role(cluster, "decode")]
        return all(i is not None and i.updated_at > since for i in fresh) and all(
            i.load.free_blocks == i.load.total_blocks and i.load.running_requests == 0
            for i in fresh
        )

    wait_until(
        idle, timeout_s=timeout_s, interval_s=0.2,
        message=lambda: str([i.load if i else None for i in fresh]),
    )  # fmt: skip


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
    two_live_decode_workers(workers)
    greedy = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    with one_torch_thread():
        want = llm.generate(PROMPTS, greedy)
    # Two streams also stop at a string late in the text (spanning 3 tokens): text held back
    # for it may be in flight when the worker dies.
    stops = {i: spanning_stop(reference_pieces(llm.tokenizer, want[i].token_ids), 3, 26)
             for i in (2, 5)}  # fmt: skip
    router = router_for(workers, max_migrations=1)

    def params(i: int) -> pb.SamplingParams:
        stop = [stops[i][0]] if i in stops else []
        return pb.SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True, stop=stop)

    requests = [pb.GenerateRequest(text=p, params=params(i)) for i, p in enumerate(PROMPTS)]
    try:
        with Streams(router, requests) as streams:
            streams.wait_for_tokens(2)
            victim, num_on_victim = busiest_decode_worker(workers, router)
            before = metrics.MIGRATIONS.labels(victim.worker_id)._value.get()
            victim.kill()
            with streams.lock:  # every stream was unfinished when the worker died
                assert max(streams.progress) <= MAX_TOKENS - 6, streams.progress
            results = streams.results()
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


class Streams:
    """Generate calls to a router, each in its own thread, their tokens counted as they come."""

    def __init__(self, router: InProcessRouter, requests: list[pb.GenerateRequest]) -> None:
        self.stub = generation_pb2_grpc.GenerationStub(grpc.insecure_channel(router.grpc_address))
        self.progress = [0] * len(requests)
        self.lock = threading.Lock()
        self.threads = ThreadPoolExecutor(len(requests))
        self.futures = [self.threads.submit(self._stream, i, r) for i, r in enumerate(requests)]

    def __enter__(self) -> Streams:
        return self

    def __exit__(self, *exc: object) -> None:
        self.threads.shutdown()

    def _stream(self, i: int, request: pb.GenerateRequest) -> list[pb.GenerateResponse]:
        messages = []
        for message in self.stub.Generate(request, timeout=300):
            messages.append(message)
            with self.lock:
                self.progress[i] += len(message.token_ids)
        return messages

    def wait_for_tokens(self, num_tokens: int, timeout_s: float = 240.0) -> None:
        """Until every stream has num_tokens tokens; none may end before."""

        def reached() -> bool:
            if min(self.progress) >= num_tokens:
                return True
            assert not any(f.done() for f in self.futures), [f.exception() for f in self.futures]
            return False

        wait_until(
            reached, timeout_s=timeout_s, interval_s=0.02, message=lambda: str(self.progress)
        )

    def results(self) -> list[list[pb.GenerateResponse]]:
        return [f.result(timeout=300) for f in self.futures]


def busiest_decode_worker(
    cluster: Cluster, router: InProcessRouter, num_requests: int = len(PROMPTS)
) -> tuple[WorkerProcess, int]:
    """The decode worker with the most of this router's num_requests in flight, and how many."""
    views = httpx.get(f"{router.http_url}/admin/workers", timeout=10).json()["workers"]
    counts = {v["worker_id"]: v["assigned_here"]["requests"] for v in views
              if v["role"] == "decode"}  # fmt: skip
    assert sum(counts.values()) == num_requests, json.dumps(counts)
    worker_id = max(sorted(counts), key=counts.__getitem__)
    (victim,) = [w for w in cluster.workers if w.worker_id == worker_id]
    return victim, counts[worker_id]


MOVED_PROMPT = "List the letters: A B C"
MOVED_MAX_TOKENS = 24


def min_tokens_case(llm) -> SamplingParams:
    """Greedy with a stop token id that ends the plain run early, and a min_tokens that holds
    it back past there: the request ends only once min_tokens tokens are out in all."""
    plain = llm.generate(MOVED_PROMPT, SamplingParams(max_tokens=MOVED_MAX_TOKENS,
                                                      temperature=0, ignore_eos=True))  # fmt: skip
    token_ids = plain[0].token_ids
    at, stop_id = next((i, t) for i, t in enumerate(token_ids) if i >= 6 and t not in token_ids[:i])
    return SamplingParams(max_tokens=MOVED_MAX_TOKENS, temperature=0, ignore_eos=True,
                          stop_token_ids=[stop_id], min_tokens=at + 4)  # fmt: skip


def test_a_moved_request_counts_the_tokens_it_streamed_as_output(workers, llm):
    """Penalties and min_tokens count every generated token, those streamed before a move
    (the new worker's prompt now) too: a moved request gives the uninterrupted tokens."""
    two_live_decode_workers(workers)
    greedy = SamplingParams(max_tokens=MOVED_MAX_TOKENS, temperature=0, ignore_eos=True)
    with one_torch_thread():
        cases = [replace(greedy, frequency_penalty=1.0), replace(greedy, presence_penalty=1.0),
                 min_tokens_case(llm)]  # fmt: skip
        want = llm.generate([MOVED_PROMPT] * len(cases), cases)
    # The hash policy puts one prompt's requests on one decode worker: all three move.
    router = router_for(workers, max_migrations=1, routing=RoutingSettings(policy="hash"))
    requests = [pb.GenerateRequest(text=MOVED_PROMPT, params=grpc_convert.sampling_proto(params))
                for params in cases]  # fmt: skip
    try:
        with Streams(router, requests) as streams:
            streams.wait_for_tokens(2)
            victim, num_on_victim = busiest_decode_worker(workers, router, len(cases))
            assert num_on_victim == len(cases)
            before = metrics.MIGRATIONS.labels(victim.worker_id)._value.get()
            victim.kill()
            results = streams.results()
        assert metrics.MIGRATIONS.labels(victim.worker_id)._value.get() - before == len(cases)
        for i, (messages, expected) in enumerate(zip(results, want, strict=True)):
            assert [t for m in messages for t in m.token_ids] == expected.token_ids, i
            assert "".join(m.text for m in messages) == expected.text, i
            assert messages[-1].finish_reason == expected.finish_reason, i
        assert want[2].finish_reason == "stop"  # the stop token id, past min_tokens
        wait_until_idle(workers)
    finally:
        router.stop()


def test_a_request_with_n_samples_is_not_moved_when_its_decode_worker_dies(workers):
    """Runs last: it kills one of two decode workers. A move resumes one token sequence, so
    n samples end with the error instead."""
    two_live_decode_workers(workers)
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
