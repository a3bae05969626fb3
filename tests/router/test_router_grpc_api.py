"""The public gRPC API on a real cluster: Generate streams and Complete returns what the
single-process engine generates; health checking and reflection are served."""

from __future__ import annotations

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from router_harness import one_torch_thread

from engine import SamplingParams
from pdserve.v1 import generation_pb2 as pb
from pdserve.v1 import generation_pb2_grpc

PROMPT = "def fibonacci(n):\n    "
NUM_TOKENS = 16


@pytest.fixture(scope="module")
def channel(cluster):
    with grpc.insecure_channel(cluster.grpc_address) as opened:
        yield opened


@pytest.fixture(scope="module")
def want(llm):
    params = SamplingParams(max_tokens=NUM_TOKENS, temperature=0, ignore_eos=True)
    with one_torch_thread():
        return llm.generate([PROMPT], params)[0]


def request(request_id: str = "") -> pb.GenerateRequest:
    params = pb.SamplingParams(max_tokens=NUM_TOKENS, temperature=0, ignore_eos=True)
    return pb.GenerateRequest(request_id=request_id, text=PROMPT, params=params)


def test_generate_streams_the_engines_tokens(channel, want):
    messages = list(generation_pb2_grpc.GenerationStub(channel).Generate(request("mine"),
                                                                          timeout=120))  # fmt: skip
    assert [t for m in messages for t in m.token_ids] == want.token_ids
    assert "".join(m.text for m in messages) == want.text
    assert [m.finish_reason for m in messages] == [""] * (len(messages) - 1) + ["length"]
    assert {m.request_id for m in messages} == {"mine"}
    assert messages[-1].usage.prompt_tokens == len(want.prompt_token_ids)
    assert messages[-1].usage.completion_tokens == NUM_TOKENS
    first = messages[0]
    assert first.token_ids and first.HasField("ttft")  # the breakdown rides on the first token
    assert first.ttft.prefill_compute_s > 0


def test_complete_returns_the_whole_completion(channel, want):
    response = generation_pb2_grpc.GenerationStub(channel).Complete(request(), timeout=120)
    assert list(response.token_ids) == want.token_ids
    assert response.text == want.text
    assert response.finish_reason == "length"
    assert response.request_id  # assigned by the router
    assert response.usage.completion_tokens == NUM_TOKENS


def test_health_and_reflection(channel):
    health = health_pb2_grpc.HealthStub(channel)
    for service in ("", "pdserve.v1.Generation"):
        status = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=10).status
        assert status == health_pb2.HealthCheckResponse.SERVING
    reflection = reflection_pb2_grpc.ServerReflectionStub(channel)
    ask = reflection_pb2.ServerReflectionRequest(list_services="")
    answer = next(reflection.ServerReflectionInfo(iter([ask]), timeout=10))
    assert {s.name for s in answer.list_services_response.service} == {
        "pdserve.v1.Generation", "grpc.health.v1.Health",
        "grpc.reflection.v1alpha.ServerReflection",
    }  # fmt: skip


def test_complete_carries_sampling_options_and_logprobs(channel, llm):
    """vLLM's options cross the gRPC API; each token comes with its logprobs (the first one's
    from the prefill worker), as the single-process engine computes them."""
    fields = dict(max_tokens=6, temperature=0, ignore_eos=True, repetition_penalty=1.3,
                  presence_penalty=0.5, min_tokens=2, logprobs=2)  # fmt: skip
    params = pb.SamplingParams(**fields, logit_bias={11: 1.5})
    response = generation_pb2_grpc.GenerationStub(channel).Complete(
        pb.GenerateRequest(text=PROMPT, params=params), timeout=120
    )
    with one_torch_thread():
        want = llm.generate([PROMPT], SamplingParams(**fields, logit_bias={11: 1.5}))[0]
    assert list(response.token_ids) == want.token_ids
    assert [lp.sampled.token_id for lp in response.logprobs] == want.token_ids
    for got, expected in zip(response.logprobs, want.logprobs, strict=True):
        assert abs(got.sampled.logprob - expected.logprob) < 1e-4
        assert [t.token_id for t in got.top] == [t for t, _ in expected.top]
