"""Backpressure on a real cluster: with prefill capacity saturated, excess requests are
rejected at once (HTTP 429 + Retry-After, gRPC RESOURCE_EXHAUSTED) while the admitted ones
complete; afterwards the router admits again. A request that no decode worker could ever hold
is no load: it gets a 400 at once."""

from __future__ import annotations

import uuid
from concurrent.futures import ThreadPoolExecutor

import grpc
import httpx
import openai
import pytest
from router_harness import MODEL

from pdserve.v1 import generation_pb2 as pb
from pdserve.v1 import generation_pb2_grpc
from router.settings import AdmissionSettings
from tests.waiting import wait_until

NUM_EXCESS = 4
# One request in prefill at a time (any prompt exceeds a 1-token budget, and an idle worker
# always takes one), and one more may wait: everything beyond is excess.
SATURATING = AdmissionSettings(prefill_token_budget=1, max_queued_requests=1,
                               max_queue_wait_s=600)  # fmt: skip


def long_prompt() -> str:
    """~1,300 tokens, unique so that no prefix cache shortens its prefill."""
    return f"Run {uuid.uuid4().hex}: " + " ".join(f"item{i}" for i in range(300))


def admin(router) -> dict:
    return httpx.get(f"{router.http_url}/admin/workers", timeout=10).json()


def in_prefill(router) -> bool:
    (prefill,) = [w for w in admin(router)["workers"] if w["role"] == "prefill"]
    return prefill["assigned_here"]["requests"] == 1


def num_queued(router) -> int:
    return sum(admin(router)["queue"].values())


def rejections(router, reason: str) -> float:
    metrics = httpx.get(f"{router.http_url}/metrics", timeout=10).text
    prefix = f'pdserve_router_rejections_total{{length_bucket="short",reason="{reason}"}} '
    return next((float(line.split()[-1]) for line in metrics.splitlines()
                 if line.startswith(prefix)), 0.0)  # fmt: skip


def test_http_429_with_retry_after_while_admitted_requests_complete(start_router):
    router = start_router(admission=SATURATING)
    client = openai.OpenAI(base_url=f"{router.http_url}/v1", api_key="none", max_retries=0,
                           timeout=180)  # fmt: skip
    ask = {"model": MODEL, "max_tokens": 4, "temperature": 0}
    rejected_before = rejections(router, "queue_full")
    with ThreadPoolExecutor(2) as pool:
        blocker = pool.submit(client.completions.create, prompt=long_prompt(), **ask)
        wait_until(
            lambda: in_prefill(router),
            timeout_s=60,
            interval_s=0.02,
            message="the long request is in prefill",
        )
        queued = pool.submit(client.completions.create, prompt="One, two, three,", **ask)
        wait_until(
            lambda: num_queued(router) == 1,
            timeout_s=60,
            interval_s=0.02,
            message="the second request is queued",
        )
        errors = []
        for _ in range(NUM_EXCESS):
            with pytest.raises(openai.RateLimitError) as excess:
                client.completions.create(prompt="Four, five,", **ask)
            errors.append(excess.value)
        admitted = [blocker.result(timeout=300), queued.result(timeout=300)]

    for error in errors:
        assert error.status_code == 429
        assert int(error.response.headers["retry-after"]) >= 1
        body = error.response.json()["error"]
        assert (body["type"], body["code"], body["param"]) == (
            "rate_limit_error", "rate_limit_exceeded", None,
        )  # fmt: skip
    assert rejections(router, "queue_full") - rejected_before == NUM_EXCESS
    for completion in admitted:
        assert completion.choices[0].finish_reason in ("length", "stop")
        assert completion.usage.completion_tokens >= 1
    assert (
        admitted[1].choices[0].text
        == client.completions.create(prompt="One, two, three,", **ask).choices[0].text
    )  # the burst is over: admitted again, and the same greedy text
    assert num_queued(router) == 0


def test_grpc_resource_exhausted_while_admitted_requests_complete(start_router):
    router = start_router(admission=SATURATING)
    stub = generation_pb2_grpc.GenerationStub(grpc.insecure_channel(router.grpc_address))
    params = pb.SamplingParams(max_tokens=4, temperature=0)

    def complete(text: str) -> pb.GenerateResponse:
        return stub.Complete(pb.GenerateRequest(text=text, params=params), timeout=300)

    with ThreadPoolExecutor(2) as pool:
        blocker = pool.submit(complete, long_prompt())
        wait_until(
            lambda: in_prefill(router),
            timeout_s=60,
            interval_s=0.02,
            message="the long request is in prefill",
        )
        queued = pool.submit(complete, "One, two, three,")
        wait_until(
            lambda: num_queued(router) == 1,
            timeout_s=60,
            interval_s=0.02,
            message="the second request is queued",
        )
        errors = []
        for _ in range(NUM_EXCESS):
            with pytest.raises(grpc.RpcError) as excess:
                complete("Four, five,")
            errors.append(excess.value)
        admitted = [blocker.result(timeout=300), queued.result(timeout=300)]

    for error in errors:
        assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "1 requests queued" in error.details()
        pushback_ms = dict(error.trailing_metadata())["grpc-retry-pushback-ms"]
        assert int(pushback_ms) >= 1000
    for response in admitted:
        assert response.finish_reason in ("length", "stop")
        assert len(response.token_ids) == response.usage.completion_tokens >= 1
    again = complete("One, two, three,")
    assert (again.text, list(again.token_ids)) == (admitted[1].text, list(admitted[1].token_ids))


def test_a_request_no_decode_worker_can_hold_gets_400_at_once(start_router):
    """A KV hold past the largest decode worker's whole cache is no load to wait out: 400 /
    INVALID_ARGUMENT naming the numbers, nothing queued or held; what fits is served."""
    # Prompt "Hello" (1 token) + 4000 reserved tokens, 5 samples: 5 x 251 blocks.
    router = start_router(admission=AdmissionSettings(kv_output_reserve_tokens=4096))
    (decode,) = [w for w in admin(router)["workers"] if w["role"] == "decode"]
    assert decode["reported_load"]["total_blocks"] == 1024
    message = (
        "this request needs 1255 KV blocks of 16 tokens (its 1-token prompt and an output "
        "reserve for each of its 5 samples), the largest decode worker has 1024"
    )
    ask = {"model": MODEL, "prompt": "Hello", "max_tokens": 4000, "n": 5}
    response = httpx.post(f"{router.http_url}/v1/completions", json=ask, timeout=60)
    assert response.status_code == 400, response.text
    error = {"message": message, "type": "invalid_request_error", "param": None,
             "code": "kv_capacity_exceeded"}  # fmt: skip
    assert response.json() == {"error": error}
    stub = generation_pb2_grpc.GenerationStub(grpc.insecure_channel(router.grpc_address))
    params = pb.SamplingParams(max_tokens=4000, n=5)
    with pytest.raises(grpc.RpcError) as refused:
        stub.Complete(pb.GenerateRequest(text="Hello", params=params), timeout=60)
    assert (refused.value.code(), refused.value.details()) == (
        grpc.StatusCode.INVALID_ARGUMENT, message,
    )  # fmt: skip
    view = admin(router)
    assert [w["assigned_here"] for w in view["workers"]] == [{"amount": 0, "requests": 0}] * 2
    assert sum(view["queue"].values()) == 0
    fits = httpx.post(f"{router.http_url}/v1/completions", timeout=120,
                      json=ask | {"max_tokens": 2, "n": 1, "temperature": 0})  # fmt: skip
    assert fits.status_code == 200, fits.text
