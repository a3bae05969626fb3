"""Network faults between separate hosts (Redis, the router, two prefill and two decode hosts;
KV over tcp, and over NIXL too for the faults on the KV path): a partition mid-transfer, a
lossy KV link, the router cut from Redis or from a decode host mid-stream. Each request still
ends with exactly the single-process engine's tokens, and every worker ends with every KV
block free (none quarantined)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack

import grpc
import httpx
import pytest

from pdserve.netns import faults_unavailable_reason
from pdserve.v1 import generation_pb2 as pb
from pdserve.v1 import generation_pb2_grpc
from tests.multihost.conftest import (
    CHUNKED_PROMPT,
    Hosts,
    WhenTransferring,
    cluster_on_hosts,
    generate,
    greedy_tokens,
    host_of,
    token_ids,
)
from tests.workers.calls import PROMPTS

pytestmark = pytest.mark.skipif(
    faults_unavailable_reason() is not None, reason=f"{faults_unavailable_reason()}"
)
MAX_TOKENS = 8


# Faults on the KV path run for each backend; the router's own links carry no KV.
EACH_KV_BACKEND = pytest.mark.parametrize("hosts", ["tcp", "nixl"], indirect=True)
TCP_ONLY = pytest.mark.parametrize("hosts", ["tcp"], indirect=True)


@pytest.fixture(scope="module")
def hosts(request) -> Iterator[Hosts]:
    with cluster_on_hosts(request.param, 2, 2, "--max-migrations", "1") as hosts:
        yield hosts


def kv_bytes_received(hosts: Hosts) -> float:
    backend = hosts.cluster.kv_backend
    return sum(d.metric("pdserve_kv_transfer_bytes_total", backend=backend, direction="received")
               for d in hosts.live("decode"))  # fmt: skip


def assert_all_idle(hosts: Hosts) -> None:
    hosts.cluster.assert_idle(*hosts.live("prefill"), *hosts.live("decode"))


@EACH_KV_BACKEND
def test_a_prefill_host_cut_off_mid_transfer_is_fenced_and_the_request_retried(hosts, llm):
    (expected,) = greedy_tokens(llm, [CHUNKED_PROMPT], MAX_TOKENS)
    attempts = lambda outcome: sum(  # noqa: E731
        d.metric("pdserve_decode_prefill_attempts_total", outcome=outcome)
        for d in hosts.live("decode")
    )
    failed_before = attempts("failed")
    decode_hosts = [host_of(d) for d in hosts.live("decode")]
    with ExitStack() as faults:
        cut = WhenTransferring(hosts, lambda prefill: faults.enter_context(
            hosts.network.cut(host_of(prefill), *decode_hosts)))  # fmt: skip
        cut.start()
        try:
            messages = generate(hosts.router, CHUNKED_PROMPT, MAX_TOKENS)
        finally:
            cut.join()
    assert token_ids(messages) == expected
    assert attempts("failed") == failed_before + 1  # then the other prefill host's attempt
    assert_all_idle(hosts)


def in_parallel(hosts: Hosts, prompts: list, max_tokens: int) -> list[list[int]]:
    """One Generate stream per prompt through the router, all at once: their tokens."""
    with ThreadPoolExecutor(len(prompts)) as pool:
        calls = [pool.submit(generate, hosts.router, p, max_tokens) for p in prompts]
        return [token_ids(call.result()) for call in calls]


@EACH_KV_BACKEND
def test_a_lossy_kv_link_under_eight_streams_loses_no_token(hosts, llm):
    # Prompts of a few hundred tokens: each request ships dozens of KV blocks over the link.
    prompts = [f"{p} " + " ".join(f"item {i} of {j}," for i in range(60)) for j, p in
               enumerate(PROMPTS)]  # fmt: skip
    expected = greedy_tokens(llm, prompts, MAX_TOKENS)
    received_before = kv_bytes_received(hosts)
    with ExitStack() as faults:
        prefill_hosts = [host_of(p) for p in hosts.live("prefill")]
        for decode in hosts.live("decode"):
            faults.enter_context(hosts.network.lossy(host_of(decode), *prefill_hosts, percent=1))
        assert in_parallel(hosts, prompts, MAX_TOKENS) == expected
    # >= 20 blocks of fp32 KV a request
    assert kv_bytes_received(hosts) - received_before >= len(prompts) * 20 * 737280
    assert_all_idle(hosts)


@TCP_ONLY
def test_the_router_cut_from_redis_serves_from_its_snapshot(hosts, llm):
    """For 10 s the router cannot read the registry: it keeps routing on the workers it last
    saw (which keep their entries fresh in Redis meanwhile) and counts the failed reads."""
    expected = greedy_tokens(llm, PROMPTS[:2], MAX_TOKENS)
    failures = lambda: hosts.router.metric(  # noqa: E731
        "pdserve_router_registry_refresh_failures_total"
    )
    before = failures()
    with hosts.network.cut(hosts.router.host, hosts.redis):
        cut_at = time.monotonic()
        while time.monotonic() < cut_at + 10:  # requests all through the outage
            assert in_parallel(hosts, PROMPTS[:2], MAX_TOKENS) == expected
        assert failures() > before
        assert httpx.get(f"{hosts.router.http_url}/health", timeout=10).status_code == 200
    assert in_parallel(hosts, PROMPTS[:2], MAX_TOKENS) == expected
    assert_all_idle(hosts)


@TCP_ONLY
def test_a_decode_host_cut_from_the_router_mid_stream_has_its_requests_moved(hosts, llm):
    max_tokens = 48
    expected = greedy_tokens(llm, PROMPTS, max_tokens)
    stub = generation_pb2_grpc.GenerationStub(grpc.insecure_channel(hosts.router.grpc_address))
    params = pb.SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    calls = [stub.Generate(pb.GenerateRequest(text=p, params=params), timeout=300)
             for p in PROMPTS]  # fmt: skip
    firsts = [next(call) for call in calls]  # every stream has begun
    views = httpx.get(f"{hosts.router.http_url}/admin/workers", timeout=10).json()["workers"]
    counts = {v["worker_id"]: v["assigned_here"]["requests"] for v in views
              if v["role"] == "decode"}  # fmt: skip
    victim_id = max(sorted(counts), key=counts.__getitem__)
    (victim,) = [d for d in hosts.live("decode") if d.worker_id == victim_id]
    migrations = lambda: hosts.router.metric(  # noqa: E731
        "pdserve_router_migrations_total", decode_worker=victim_id
    )
    before = migrations()
    with hosts.network.cut(hosts.router.host, host_of(victim)):
        results = [token_ids([first, *call]) for first, call in zip(firsts, calls, strict=True)]
    assert results == expected
    assert migrations() - before == counts[victim_id] >= 1
    assert_all_idle(hosts)
