"""n > 1 through the official openai client and the gRPC API on the real cluster: the prompt
is prefilled once (the prefill worker's request count), its samples share the KV through the
decode worker's prefix cache, and with a seed choice i is what the engine gives an n = 1
request seeded seed + i, the same on every run."""

from __future__ import annotations

from collections import defaultdict

import grpc
import openai
import pytest
from openai import OpenAI
from router_harness import MODEL, one_torch_thread

from engine import SamplingParams
from pdserve.registry import Registry
from pdserve.v1 import generation_pb2 as pb
from pdserve.v1 import generation_pb2_grpc
from tests.cluster import metric

PROMPT = "Write a short poem about the sea:"
SEEDED = {"max_tokens": 6, "temperature": 1.0, "seed": 2024}


@pytest.fixture(scope="module")
def client(cluster) -> OpenAI:
    return OpenAI(base_url=f"{cluster.http_url}/v1", api_key="none", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def seeded_samples(llm) -> list[str]:
    """The engine's n = 1 outputs seeded 2024, 2025 and 2026."""
    params = SamplingParams(max_tokens=6, temperature=1.0, seed=2024, n=3)
    with one_torch_thread():
        outputs = llm.generate([PROMPT] * 3, [params.sample(i) for i in range(3)])
    return [o.text for o in outputs]


def prefill_requests(cluster) -> float:
    (info,) = Registry(cluster.redis_url).workers("prefill")
    return metric(info.metrics_url, "pdserve_prefill_requests_total", outcome="ok")


def test_seeded_n3_is_reproducible_and_prefilled_once(client, cluster, seeded_samples):
    runs = []
    for _ in range(2):
        before = prefill_requests(cluster)
        out = client.completions.create(model=MODEL, prompt=PROMPT, n=3, **SEEDED)
        assert prefill_requests(cluster) - before == 1  # one prefill for the three samples
        runs.append(out)
    for out in runs:
        assert [c.index for c in out.choices] == [0, 1, 2]
        assert [c.text for c in out.choices] == seeded_samples
        assert [c.finish_reason for c in out.choices] == ["length"] * 3
        assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (8, 18)
    assert len(set(seeded_samples)) == 3  # temperature 1: three different samples


def test_greedy_n2_gives_the_n1_output_twice(client):
    greedy = {"max_tokens": 5, "temperature": 0}
    one = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], **greedy
    )
    two = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], n=2, **greedy
    )
    assert [c.index for c in two.choices] == [0, 1]
    assert [c.message.content for c in two.choices] == [one.choices[0].message.content] * 2
    assert two.usage.completion_tokens == 2 * one.usage.completion_tokens
    assert two.usage.prompt_tokens == one.usage.prompt_tokens


@pytest.mark.parametrize("kind", ["completions", "chat"])
def test_streamed_n2_chunks_carry_their_index(client, seeded_samples, kind):
    fields = {"n": 2, "stream": True, "stream_options": {"include_usage": True}, **SEEDED}
    if kind == "chat":
        chunks = list(client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": PROMPT}], **fields
        ))  # fmt: skip
        roles = [c.choices[0].index for c in chunks[:2]]
        assert roles == [0, 1] and {c.choices[0].delta.role for c in chunks[:2]} == {"assistant"}
    else:
        chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, **fields))
    texts: dict[int, str] = defaultdict(str)
    finishes: dict[int, list[str]] = defaultdict(list)
    for chunk in chunks[:-1]:
        (choice,) = chunk.choices
        delta = choice.delta.content if kind == "chat" else choice.text
        texts[choice.index] += delta or ""
        if choice.finish_reason:
            finishes[choice.index].append(choice.finish_reason)
    assert dict(finishes) == {0: ["length"], 1: ["length"]}  # one finish per choice
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    if kind == "completions":
        assert [texts[0], texts[1]] == seeded_samples[:2]


def test_each_choice_has_its_own_logprobs_and_grammar(client):
    greedy = {"max_tokens": 4, "temperature": 0, "logprobs": 1, "echo": True}
    (one,) = client.completions.create(model=MODEL, prompt=PROMPT, **greedy).choices
    two = client.completions.create(model=MODEL, prompt=PROMPT, n=2, **greedy).choices
    for choice in two:
        assert choice.text == one.text
        assert choice.logprobs.tokens == one.logprobs.tokens
        assert choice.logprobs.text_offset == one.logprobs.text_offset  # each after the echo
        # Sample 1's first token comes from the decode worker's own last-block prefill.
        assert choice.logprobs.token_logprobs == pytest.approx(
            one.logprobs.token_logprobs, abs=1e-4
        )
    choices = ["yes", "no", "maybe"]
    constrained = client.completions.create(
        model=MODEL, prompt=PROMPT, n=3, max_tokens=4, temperature=1.0, seed=5,
        extra_body={"guided_choice": choices},
    )  # fmt: skip
    assert all(c.text in choices for c in constrained.choices), constrained.choices


@pytest.mark.parametrize("n", [0, 17])
def test_n_out_of_range_gets_a_400_naming_n(client, n):
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, n=n)
    assert refused.value.body["param"] == "n"
    assert refused.value.body["message"].startswith("n: Input should be")


def test_grpc_generate_and_complete_carry_the_index(cluster, seeded_samples):
    params = pb.SamplingParams(max_tokens=6, temperature=1.0, seed=2024, n=3)
    request = pb.GenerateRequest(text=PROMPT, params=params)
    with grpc.insecure_channel(cluster.grpc_address) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        messages = list(stub.Generate(request, timeout=120))
        whole = stub.Complete(request, timeout=120)
    texts: dict[int, str] = defaultdict(str)
    for message in messages:
        texts[message.index] += message.text
    assert [texts[i] for i in range(3)] == seeded_samples
    assert sorted(m.index for m in messages if m.finish_reason) == [0, 1, 2]
    assert messages[-1].usage.completion_tokens == 18
    assert [(c.index, c.text, c.finish_reason) for c in whole.choices] == [
        (i, text, "length") for i, text in enumerate(seeded_samples)
    ]
    assert (whole.text, whole.usage.completion_tokens) == (seeded_samples[0], 18)
    with pytest.raises(grpc.RpcError) as refused, grpc.insecure_channel(cluster.grpc_address) as ch:
        bad = pb.GenerateRequest(text=PROMPT, params=pb.SamplingParams(n=17))
        generation_pb2_grpc.GenerationStub(ch).Complete(bad, timeout=60)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert refused.value.details() == "n must be in [1, 16], got 17"
