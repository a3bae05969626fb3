"""Backpressure on a real cluster: with prefill capacity saturated, excess requests are
rejected at once (HTTP 429 + Retry-After, gRPC RESOURCE_EXHAUSTED) while the admitted ones
complete; afterwards the router admits again. With a TTFT objective, an open-loop burst is shed
by its predicted TTFT, which every admitted response carries in a header. A request that no
decode worker could ever hold is no load: it gets a 400 at once."""

from __future__ import annotations

import re
import uuid
from concurrent.futures import ThreadPoolExecutor

import grpc
import httpx
import openai
import pytest
from router_harness import MODEL

from pdserve.v1 import generation_pb2 as pb
from pdserve.v1 import generation_pb2_grpc
from router.http_api.app import PREDICTED_TTFT_HEADER
from router.settings import AdmissionSettings
from tests.cluster import sample_value
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


def metric(router, name: str, **labels: str) -> float:
    """One sample's value from the router's /metrics (0 before it exists)."""
    return sample_value(httpx.get(f"{router.http_url}/metrics", timeout=10).text, name, **labels)


def rejections(router, reason: str, bucket: str = "short") -> float:
    return metric(router, "pdserve_router_rejections_total", length_bucket=bucket, reason=reason)


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


def predicted_ttft_sum(router) -> float:
    return metric(router, "pdserve_router_ttft_predicted_seconds_sum", length_bucket="short")


def test_an_admitted_response_carries_the_ttft_admission_predicted(start_router):
    """The header is the prediction admission made at arrival: the same number its
    pdserve_router_ttft_predicted_seconds histogram observed, streamed or not."""
    router = start_router()
    ask = {"model": MODEL, "prompt": "One, two, three,", "max_tokens": 4, "temperature": 0}
    for stream in (False, True):
        before_s = predicted_ttft_sum(router)
        with httpx.stream("POST", f"{router.http_url}/v1/completions", timeout=120,
                          json=ask | {"stream": stream}) as response:  # fmt: skip
            assert response.status_code == 200, response.read()
            response.read()
        predicted_s = float(response.headers[PREDICTED_TTFT_HEADER])
        assert predicted_s > 0
        assert predicted_s == pytest.approx(predicted_ttft_sum(router) - before_s, abs=5e-4)


NUM_BURST = 12
SLO_S = 0.5
SHED_MESSAGE = re.compile(
    r"predicted time to first token \d+\.\d s( \(\d+\.\d s at the 99th percentile\))? is over "
    r"the 0\.5 s SLO; retry in (\d+) s"
)


def test_an_overloaded_open_loop_gets_429s_with_retry_after(start_router):
    """A burst sent while a long prefill runs, none waiting for another's answer: whatever the
    prefill speed, the tokens in front soon predict more than the objective, so some of the
    burst is shed at arrival (429, Retry-After, OpenAI's error body, counted as queue_wait)
    while every admitted request completes; once the burst is over the router admits again."""
    router = start_router(admission=AdmissionSettings(ttft_slo_s=SLO_S))
    ask = {"model": MODEL, "max_tokens": 4, "temperature": 0}
    rejected_before = rejections(router, "queue_wait", "medium")

    def complete(prompt: str) -> httpx.Response:
        return httpx.post(f"{router.http_url}/v1/completions", json=ask | {"prompt": prompt},
                          timeout=600)  # fmt: skip

    with ThreadPoolExecutor(NUM_BURST + 1) as pool:
        blocker = pool.submit(complete, long_prompt())
        wait_until(
            lambda: in_prefill(router) or blocker.done(),
            timeout_s=60,
            interval_s=0.02,
            message="the long request is in prefill",
        )
        burst = [pool.submit(complete, long_prompt()) for _ in range(NUM_BURST)]
        responses = [blocker.result(timeout=600)] + [f.result(timeout=600) for f in burst]

    shed = [r for r in responses if r.status_code == 429]
    admitted = [r for r in responses if r.status_code != 429]
    assert shed, [r.status_code for r in responses]
    for response in shed:
        error = response.json()["error"]
        assert (error["type"], error["code"], error["param"]) == (
            "rate_limit_error", "rate_limit_exceeded", None,
        )  # fmt: skip
        match = SHED_MESSAGE.fullmatch(error["message"])
        assert match, error["message"]
        # The message rounds the excess, the header rounds it up (and is at least 1 s).
        num_seconds = int(match.group(2))
        assert int(response.headers["retry-after"]) in (max(1, num_seconds), num_seconds + 1)
        assert PREDICTED_TTFT_HEADER not in response.headers
    assert rejections(router, "queue_wait", "medium") - rejected_before == len(shed)
    for response in admitted:
        assert response.status_code == 200, response.text
        assert response.json()["choices"][0]["finish_reason"] in ("length", "stop")
        assert float(response.headers[PREDICTED_TTFT_HEADER]) > 0
    wait_until(
        lambda: num_queued(router) == 0 and complete("One, two, three,").status_code == 200,
        timeout_s=120,
        interval_s=1.0,
        message="the router admits again after the burst",
    )
