"""Structured output on the real cluster (llguidance masks the logits on both workers): the
output follows the schema, regex or choice it was given, in OpenAI's and vLLM's spellings and
over gRPC; a constraint that cannot compile is a 400 naming its field; no KV block is left."""

from __future__ import annotations

import json
import re

import grpc
import jsonschema
import openai
import pytest
from openai import OpenAI
from router_harness import MODEL, assert_cancelled_downstream

from pdserve.v1 import generation_pb2 as pb
from pdserve.v1 import generation_pb2_grpc

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "city": {"type": "string", "maxLength": 24},
    },
    "required": ["name", "age", "city"],
    "additionalProperties": False,
}
PROMPTS = [
    "Describe a chef as JSON.",
    "Give me a fictional astronaut as JSON.",
    "Invent a person who lives in Paris. Answer in JSON.",
    "Who is your favourite author? Reply as JSON.",
    "Make up a character for a story, in JSON.",
]


@pytest.fixture(scope="module")
def client(cluster) -> OpenAI:
    return OpenAI(base_url=f"{cluster.http_url}/v1", api_key="none", max_retries=0, timeout=120)


def _chat(client: OpenAI, prompt: str, **fields):
    out = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": prompt}], max_tokens=60,
        temperature=0, **fields,
    )  # fmt: skip
    return out.choices[0]


@pytest.mark.parametrize("prompt", PROMPTS)
def test_json_schema_output_validates(client, prompt):
    choice = _chat(client, prompt, response_format={
        "type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}})  # fmt: skip
    assert choice.finish_reason == "stop"  # the grammar completed, not max_tokens
    jsonschema.validate(json.loads(choice.message.content), PERSON)


def test_choice_regex_and_json_object(client, cluster):
    sentiment = _chat(client, "Is 'I love it' positive or negative?",
                      extra_body={"guided_choice": ["positive", "negative"]})  # fmt: skip
    assert sentiment.message.content in ("positive", "negative")
    phone = client.completions.create(
        model=MODEL, prompt="Call me at", max_tokens=20, temperature=0,
        extra_body={"structured_outputs": {"regex": r" [0-9]{3}-[0-9]{4}"}},
    )  # fmt: skip
    assert re.fullmatch(r" [0-9]{3}-[0-9]{4}", phone.choices[0].text)
    anything = _chat(client, "Tell me about cats.", response_format={"type": "json_object"})
    assert isinstance(json.loads(anything.message.content), dict)
    stub = generation_pb2_grpc.GenerationStub(grpc.insecure_channel(cluster.grpc_address))
    constraint = pb.StructuredOutput(choice=pb.Choices(choices=["yes", "no"]))
    params = pb.SamplingParams(max_tokens=8, temperature=0, structured_output=constraint)
    whole = stub.Complete(pb.GenerateRequest(text="Is water wet?", params=params), timeout=120)
    assert whole.text in ("yes", "no")
    assert_cancelled_downstream(cluster)  # every constrained request gave its KV back


BAD = [
    # extra fields -> the param the 400 names, the start of its message
    pytest.param({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "nonsense"}}}}, "response_format",
        "response_format: invalid json_schema: ", id="bad-schema"),
    pytest.param({"guided_regex": "[0-9"}, "guided_regex", "guided_regex: invalid regex: ",
                 id="bad-regex"),
    pytest.param({"structured_outputs": {"choice": []}}, "structured_outputs.choice",
                 "structured_outputs.choice: invalid choice: ", id="no-choices"),
    pytest.param({"response_format": {"type": "json_schema"}}, "response_format.json_schema",
                 "response_format json_schema needs json_schema.schema", id="no-schema"),
    pytest.param({"guided_json": PERSON, "guided_regex": "a+"}, "guided_regex",
                 "one structured output constraint per request: guided_json and guided_regex",
                 id="two-constraints"),
]  # fmt: skip


@pytest.mark.parametrize("fields, param, message", BAD)
def test_a_constraint_that_cannot_compile_is_a_400(client, fields, param, message):
    with pytest.raises(openai.BadRequestError) as refused:
        _chat(client, "Hi", extra_body=fields)
    assert refused.value.body["param"] == param
    assert refused.value.body["message"].startswith(message), refused.value.body["message"]


def test_grpc_constraints_are_checked_by_the_worker(cluster):
    stub = generation_pb2_grpc.GenerationStub(grpc.insecure_channel(cluster.grpc_address))
    params = pb.SamplingParams(structured_output=pb.StructuredOutput(regex="[0-9"))
    with pytest.raises(grpc.RpcError) as refused:
        stub.Complete(pb.GenerateRequest(text="Hi", params=params), timeout=120)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert refused.value.details().startswith("invalid regex: "), refused.value.details()
