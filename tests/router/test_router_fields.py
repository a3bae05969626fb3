"""Nothing silently dropped: every documented OpenAI / vLLM request field is honoured or gets a
400 naming it (and docs/router.md's table says which); the honoured extensions do what vLLM
documents, through the official openai client against the real cluster."""

from __future__ import annotations

import re
from pathlib import Path

import httpx
import openai
import pytest
from openai import OpenAI
from router_harness import MODEL

from router.http_api.schemas import ChatBody, CompletionBody

# OpenAI's API reference (completions, chat completions) and vLLM's extra parameters.
OPENAI_COMPLETION = {
    "model", "prompt", "best_of", "echo", "frequency_penalty", "logit_bias", "logprobs",
    "max_tokens", "n", "presence_penalty", "seed", "stop", "stream", "stream_options", "suffix",
    "temperature", "top_p", "user",
}  # fmt: skip
OPENAI_CHAT = {
    "messages", "model", "audio", "frequency_penalty", "function_call", "functions",
    "logit_bias", "logprobs", "max_completion_tokens", "max_tokens", "metadata", "modalities",
    "n", "parallel_tool_calls", "prediction", "presence_penalty", "prompt_cache_key",
    "prompt_cache_retention", "reasoning_effort", "response_format", "safety_identifier", "seed",
    "service_tier", "stop", "store", "stream", "stream_options", "temperature", "tool_choice",
    "tools", "top_logprobs", "top_p", "user", "verbosity", "web_search_options",
}  # fmt: skip
VLLM_COMMON = {
    "use_beam_search", "top_k", "min_p", "repetition_penalty", "length_penalty",
    "stop_token_ids", "include_stop_str_in_output", "ignore_eos", "min_tokens",
    "skip_special_tokens", "spaces_between_special_tokens", "truncate_prompt_tokens",
    "allowed_token_ids", "prompt_logprobs", "bad_words", "add_special_tokens", "response_format",
    "structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
    "guided_whitespace_pattern", "guided_decoding_backend", "priority", "request_id",
    "logits_processors", "return_tokens_as_token_ids", "return_token_ids", "cache_salt",
    "kv_transfer_params", "vllm_xargs", "stream_options.include_obfuscation",
}  # fmt: skip
VLLM_COMPLETION = VLLM_COMMON | {"prompt_embeds"}
VLLM_CHAT = VLLM_COMMON | {
    "echo", "add_generation_prompt", "continue_final_message", "documents", "chat_template",
    "chat_template_kwargs", "mm_processor_kwargs", "include_reasoning", "structural_tag",
}  # fmt: skip
ENDPOINTS = {
    "completions": (CompletionBody, OPENAI_COMPLETION | VLLM_COMPLETION),
    "chat": (ChatBody, OPENAI_CHAT | VLLM_CHAT),
}


def _statuses(endpoint: str) -> dict[str, str]:
    """field -> "honoured" | "400" from the code."""
    body, _ = ENDPOINTS[endpoint]
    honoured = dict.fromkeys(body.model_fields, "honoured")
    refused = {field.name: "400" for field in body.refused}
    assert not honoured.keys() & refused.keys(), "a field both honoured and refused"
    return honoured | refused


def _table() -> dict[str, dict[str, str]]:
    """endpoint -> field -> "honoured" | "400" | "—" from docs/router.md."""
    docs = (Path(__file__).parents[2] / "docs" / "router.md").read_text()
    section = docs.split("### Request fields", 1)[1].split("\n\n`X-Request-Id`", 1)[0]
    table: dict[str, dict[str, str]] = {"completions": {}, "chat": {}}
    for row in re.findall(r"^\| (`.+)$", section, re.MULTILINE):
        names, completions, chat, _ = (cell.strip() for cell in row.split(" | "))
        for name in re.findall(r"`([^`]+)`", names):
            table["completions"][name] = completions.split(" ")[0]
            table["chat"][name] = chat.split(" ")[0]
    return table


@pytest.mark.parametrize("endpoint", ENDPOINTS)
def test_every_documented_field_is_honoured_or_refused(endpoint):
    _, documented = ENDPOINTS[endpoint]
    assert sorted(documented - _statuses(endpoint).keys()) == []


@pytest.mark.parametrize("endpoint", ENDPOINTS)
def test_the_docs_table_says_what_the_code_does(endpoint):
    table = {name: status for name, status in _table()[endpoint].items() if status != "—"}
    assert table == _statuses(endpoint)


@pytest.fixture(scope="module")
def client(cluster) -> OpenAI:
    return OpenAI(base_url=f"{cluster.http_url}/v1", api_key="none", max_retries=0, timeout=120)


CHAT = [{"role": "user", "content": "Hi"}]
REFUSED = [
    # (endpoint, extra fields) -> the param the 400 names
    pytest.param("completions", {"suffix": "!"}, "suffix", id="suffix"),
    pytest.param("completions", {"use_beam_search": True}, "use_beam_search", id="beam-search"),
    pytest.param("completions", {"service_tier": "flex"}, "service_tier", id="service-tier"),
    pytest.param("chat", {"store": True}, "store", id="store"),
    pytest.param("chat", {"web_search_options": {}}, "web_search_options", id="web-search"),
    pytest.param("chat", {"stream_options": {"include_obfuscation": True}, "stream": True},
                 "stream_options.include_obfuscation", id="obfuscation"),
]  # fmt: skip


def _create(client: OpenAI, endpoint: str, **fields: object):
    if endpoint == "chat":
        return client.chat.completions.create(model=MODEL, messages=CHAT, **fields)
    return client.completions.create(model=MODEL, prompt="Hi", **fields)


@pytest.mark.parametrize("endpoint, fields, param", REFUSED)
def test_refused_fields_get_a_400_naming_them(client, endpoint, fields, param):
    with pytest.raises(openai.BadRequestError) as refused:
        _create(client, endpoint, max_tokens=2, extra_body=fields)
    error = refused.value.body
    assert (error["type"], error["param"]) == ("invalid_request_error", param)
    assert error["message"].startswith(f"{param} is not supported by this server ("), error


def test_values_that_ask_for_nothing_pass(client):
    out = client.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=2, temperature=0, n=1, store=False,
        service_tier="auto", modalities=["text"], extra_body={"vendor_field": 1},
    )  # fmt: skip
    assert out.usage.completion_tokens == 2


PROMPT = "The capital of France is"


def test_echo_puts_the_prompt_in_front(client):
    plain = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0)
    echoed = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0, echo=True
    )
    assert echoed.choices[0].text == PROMPT + plain.choices[0].text
    chunks = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0, echo=True, stream=True
    )
    assert "".join(c.choices[0].text for c in chunks) == PROMPT + plain.choices[0].text


def test_truncate_prompt_tokens_keeps_the_last_tokens(client, llm):
    ids = llm.tokenizer.encode(PROMPT)
    last = client.completions.create(model=MODEL, prompt=ids[-3:], max_tokens=4, temperature=0)
    truncated = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0,
        extra_body={"truncate_prompt_tokens": 3},
    )  # fmt: skip
    assert truncated.usage.prompt_tokens == 3
    assert truncated.choices[0].text == last.choices[0].text


def test_continuous_usage_stats_counts_every_chunk(client):
    chunks = list(client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True},
    ))  # fmt: skip
    counts = [c.usage.completion_tokens for c in chunks]
    assert counts == sorted(counts) and counts[-1] == 5
    assert {c.usage.prompt_tokens for c in chunks} == {chunks[-1].usage.prompt_tokens}


def test_x_request_id_in_and_out(cluster):
    url = f"{cluster.http_url}/v1/completions"
    request = {"model": MODEL, "prompt": "Hi", "max_tokens": 1}
    given = httpx.post(url, json=request, headers={"X-Request-Id": "trace-42"}, timeout=60)
    assert given.headers["x-request-id"] == "trace-42"
    assert given.json()["id"] == "cmpl-trace-42"
    field = httpx.post(url, json=request | {"request_id": "from-body"}, timeout=60)
    assert (field.headers["x-request-id"], field.json()["id"]) == ("from-body", "cmpl-from-body")
    generated = httpx.post(url, json=request, timeout=60)
    assert re.fullmatch(r"[0-9a-f]{32}", generated.headers["x-request-id"])
    assert generated.json()["id"] == f"cmpl-{generated.headers['x-request-id']}"
    refused = httpx.post(url, json=request, headers={"X-Request-Id": "a b"}, timeout=60)
    assert refused.status_code == 400
    assert refused.json()["error"]["param"] == "x-request-id"
    error = httpx.post(url, json=request | {"suffix": "!"}, headers={"X-Request-Id": "e1"})
    assert (error.status_code, error.headers["x-request-id"]) == (400, "e1")
