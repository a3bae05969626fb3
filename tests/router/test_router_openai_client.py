"""The official openai client against the router on a real cluster: text, usage and finish
reasons equal the single-process engine's, streamed or not, completions and chat."""

from __future__ import annotations

from dataclasses import dataclass

import openai
import pytest
from openai import OpenAI
from router_harness import MODEL, one_torch_thread

from engine import SamplingParams

PROMPT = "The capital of France is"
CHAT = [{"role": "user", "content": "Name three primary colors."}]
# name: (OpenAI request fields, the same request as engine SamplingParams)
CASES = {
    "greedy": ({"max_tokens": 12, "temperature": 0}, SamplingParams(max_tokens=12, temperature=0)),
    "seeded-sampling": (
        {"max_tokens": 16, "temperature": 0.8, "seed": 7, "top_p": 0.9},
        SamplingParams(max_tokens=16, temperature=0.8, seed=7, top_p=0.9),
    ),
    "penalties": (
        {
            "max_tokens": 12,
            "temperature": 0,
            "presence_penalty": 0.5,
            "frequency_penalty": 0.5,
            "logit_bias": {"11": 2.5},
            "extra_body": {"repetition_penalty": 1.2, "min_tokens": 6},
        },
        SamplingParams(
            max_tokens=12,
            temperature=0,
            presence_penalty=0.5,
            frequency_penalty=0.5,
            logit_bias={11: 2.5},
            repetition_penalty=1.2,
            min_tokens=6,
        ),
    ),  # fmt: skip
    "seeded-min-p": (
        {"max_tokens": 16, "temperature": 1.0, "seed": 11, "extra_body": {"min_p": 0.1}},
        SamplingParams(max_tokens=16, temperature=1.0, seed=11, min_p=0.1),
    ),
    "stop-string": (
        {"max_tokens": 40, "temperature": 0, "stop": ["\n"]},
        SamplingParams(max_tokens=40, temperature=0, stop=["\n"]),
    ),
}
CHAT_CASES = {
    "chat": SamplingParams(max_tokens=24, temperature=0),
    "chat-ignore-eos": SamplingParams(max_tokens=20, temperature=0, ignore_eos=True),
}


@dataclass(frozen=True, slots=True)
class Expected:
    text: str
    finish_reason: str
    num_prompt_tokens: int
    num_output_tokens: int


@pytest.fixture(scope="module")
def expected(llm) -> dict[str, Expected]:
    """The single-process engine's outputs for every case, in one batch (batched == alone)."""
    chat_prompt = llm.tokenizer.apply_chat_template(CHAT)
    names = [*CASES, *CHAT_CASES]
    prompts = [PROMPT] * len(CASES) + [chat_prompt] * len(CHAT_CASES)
    params = [p for _, p in CASES.values()] + list(CHAT_CASES.values())
    with one_torch_thread():
        outputs = llm.generate(prompts, params)
    return {
        name: Expected(o.text, o.finish_reason, len(o.prompt_token_ids), len(o.token_ids))
        for name, o in zip(names, outputs, strict=True)
    }


@pytest.fixture(scope="module")
def client(cluster) -> OpenAI:
    return OpenAI(base_url=f"{cluster.http_url}/v1", api_key="none", max_retries=0, timeout=120)


@pytest.mark.parametrize("case", CASES)
def test_completions(client, expected, case):
    want = expected[case]
    out = client.completions.create(model=MODEL, prompt=PROMPT, **CASES[case][0])
    assert out.choices[0].text == want.text
    assert out.choices[0].finish_reason == want.finish_reason
    assert (out.usage.prompt_tokens, out.usage.completion_tokens, out.usage.total_tokens) == (
        want.num_prompt_tokens, want.num_output_tokens,
        want.num_prompt_tokens + want.num_output_tokens,
    )  # fmt: skip


@pytest.mark.parametrize("case", ["greedy", "seeded-sampling", "penalties"])
def test_completions_streamed(client, expected, case):
    want = expected[case]
    chunks = list(client.completions.create(
        model=MODEL, prompt=PROMPT, stream=True, stream_options={"include_usage": True},
        **CASES[case][0],
    ))  # fmt: skip
    assert "".join(c.choices[0].text for c in chunks if c.choices) == want.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == want.finish_reason
    assert chunks[-1].choices == []  # the usage chunk include_usage asks for
    assert (chunks[-1].usage.prompt_tokens, chunks[-1].usage.completion_tokens) == (
        want.num_prompt_tokens, want.num_output_tokens,
    )  # fmt: skip


def test_chat_completions(client, expected):
    want = expected["chat"]
    out = client.chat.completions.create(
        model=MODEL, messages=CHAT, max_completion_tokens=24, temperature=0
    )
    assert out.choices[0].message.role == "assistant"
    assert out.choices[0].message.content == want.text
    assert out.choices[0].finish_reason == want.finish_reason
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (
        want.num_prompt_tokens, want.num_output_tokens,
    )  # fmt: skip


def test_chat_completions_streamed_with_ignore_eos(client, expected):
    want = expected["chat-ignore-eos"]
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=20, temperature=0, stream=True,
        extra_body={"ignore_eos": True},
    ))  # fmt: skip
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want.text
    assert chunks[-1].choices[0].finish_reason == want.finish_reason == "length"
    assert want.num_output_tokens == 20
    assert all(c.usage is None for c in chunks)  # no include_usage: no usage chunk


def test_prompt_as_token_ids(client, expected, llm):
    out = client.completions.create(
        model=MODEL, prompt=llm.tokenizer.encode(PROMPT), max_tokens=12, temperature=0
    )
    assert out.choices[0].text == expected["greedy"].text


def test_models_lists_the_served_model(client):
    assert [m.id for m in client.models.list()] == [MODEL]


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"logit_bias": {"49152": 1}}, "logit_bias token ids [49152] are outside [0, 49152)"),
        ({"logit_bias": {"5": 101}}, "logit_bias for token 5 must be in [-100, 100], got 101.0"),
        ({"presence_penalty": -2.5}, "presence_penalty must be in [-2, 2], got -2.5"),
    ],
)
def test_bad_sampling_options_get_a_400(client, fields, message):
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, **fields)
    assert refused.value.body["message"] == message
