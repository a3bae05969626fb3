"""The endpoints beside generation on the real cluster: vLLM's /tokenize and /detokenize,
/version, the model card, and FastAPI's /openapi.json (a valid OpenAPI 3 document that names
the real request models) and /docs."""

from __future__ import annotations

import httpx
import openai
import pytest
from openai import OpenAI
from openapi_spec_validator import validate
from router_harness import MODEL

PROMPT = "The capital of France is"
PROMPT_IDS = [504, 3575, 282, 4649, 314]
CHAT = [{"role": "user", "content": "Hi"}]
CHAT_IDS = [  # SmolLM2's template with its default system prompt, and the assistant's turn
    1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308, 34519, 28, 7018, 411, 407,
    19712, 8182, 2, 198, 1, 4093, 198, 26843, 2, 198, 1, 520, 9531, 198,
]  # fmt: skip
CONTEXT = 8192  # the workers' max_model_len


def _post(cluster, path: str, **body: object) -> httpx.Response:
    return httpx.post(f"{cluster.http_url}{path}", json=body, timeout=60)


def test_tokenize_a_prompt_and_a_chat(cluster):
    prompt = _post(cluster, "/tokenize", model=MODEL, prompt=PROMPT, return_token_strs=True)
    assert prompt.json() == {
        "count": 5, "max_model_len": CONTEXT, "tokens": PROMPT_IDS,
        "token_strs": ["The", "Ġcapital", "Ġof", "ĠFrance", "Ġis"],
    }  # fmt: skip
    chat = _post(cluster, "/tokenize", messages=CHAT)
    assert chat.json() == {"count": len(CHAT_IDS), "max_model_len": CONTEXT, "tokens": CHAT_IDS}
    no_turn = _post(cluster, "/tokenize", messages=CHAT, add_generation_prompt=False)
    assert no_turn.json()["tokens"] == CHAT_IDS[:-4]  # without "<|im_start|>assistant\n"
    tools = _post(cluster, "/tokenize", messages=CHAT, tools=[
        {"type": "function", "function": {"name": "f"}}])  # fmt: skip
    assert (tools.status_code, tools.json()["error"]["param"]) == (400, "tools")


def test_detokenize(cluster):
    assert _post(cluster, "/detokenize", tokens=PROMPT_IDS).json() == {"prompt": PROMPT}
    assert _post(cluster, "/detokenize", tokens=[1, 2]).json() == {
        "prompt": "<|im_start|><|im_end|>"  # special tokens are kept, as vLLM does
    }
    outside = _post(cluster, "/detokenize", tokens=[504, 49152])
    assert outside.status_code == 400
    assert outside.json()["error"]["param"] == "tokens.1"


def test_version_and_the_model_card(cluster):
    assert httpx.get(f"{cluster.http_url}/version").json() == {"version": "0.1.0"}
    client = OpenAI(base_url=f"{cluster.http_url}/v1", api_key="none", max_retries=0)
    card = client.models.retrieve(MODEL)
    assert (card.id, card.model_extra["max_model_len"]) == (MODEL, CONTEXT)
    assert [m.model_extra["max_model_len"] for m in client.models.list()] == [CONTEXT]
    with pytest.raises(openai.NotFoundError) as missing:
        client.models.retrieve("gpt-4o")
    assert (missing.value.body["param"], missing.value.body["code"]) == ("model", "model_not_found")


def test_openapi_is_valid_and_names_the_request_models(cluster):
    schema = httpx.get(f"{cluster.http_url}/openapi.json").json()
    validate(schema)  # raises on an invalid OpenAPI 3 document
    assert schema["openapi"].startswith("3.")
    body = schema["paths"]["/v1/chat/completions"]["post"]["requestBody"]
    ref = body["content"]["application/json"]["schema"]["$ref"]
    chat_body = schema["components"]["schemas"][ref.rsplit("/", 1)[1]]
    assert {"messages", "tools", "max_completion_tokens"} <= chat_body["properties"].keys()
    assert chat_body["required"] == ["messages"]
    docs = httpx.get(f"{cluster.http_url}/docs")
    assert docs.status_code == 200 and "swagger-ui" in docs.text
