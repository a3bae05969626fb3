"""Chat through the model's template on the real cluster, with the official openai client:
names, tool calls and tool results reach the template; tools and template arguments the
template does not read get a 400 naming them; vLLM's add_generation_prompt,
continue_final_message and echo."""

from __future__ import annotations

import openai
import pytest
from openai import OpenAI
from router_harness import MODEL

MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "name": "ann", "content": [{"type": "text", "text": "Weather in "},
                                               {"type": "text", "text": "Paris?"}]},
    {"role": "assistant", "content": None, "tool_calls": [{
        "id": "c1", "type": "function",
        "function": {"name": "weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "c1", "content": "18 C"},
]  # fmt: skip
RENDERED = (  # SmolLM's template writes role and content only
    "<|im_start|>system\nBe brief.<|im_end|>\n"
    "<|im_start|>user\nWeather in Paris?<|im_end|>\n"
    "<|im_start|>assistant\n<|im_end|>\n"
    "<|im_start|>tool\n18 C<|im_end|>\n"
)
TOOLS = [{"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}]


@pytest.fixture(scope="module")
def client(cluster) -> OpenAI:
    return OpenAI(base_url=f"{cluster.http_url}/v1", api_key="none", max_retries=0, timeout=120)


def _chat(client: OpenAI, messages=MESSAGES, **fields):
    return client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=3, temperature=0, **fields
    )


def _complete(client: OpenAI, prompt: str) -> str:
    out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=3, temperature=0)
    return out.choices[0].text


def test_tool_calls_results_and_text_parts_reach_the_template(client, llm):
    prompt = RENDERED + "<|im_start|>assistant\n"
    out = _chat(client)
    assert out.usage.prompt_tokens == len(llm.tokenizer.encode(prompt))
    assert out.choices[0].message.content == _complete(client, prompt)
    without = _chat(client, extra_body={"add_generation_prompt": False})
    assert without.usage.prompt_tokens == len(llm.tokenizer.encode(RENDERED))


def test_continue_final_message_with_echo(client, llm):
    messages = [MESSAGES[0], {"role": "user", "content": "Count to five."},
                {"role": "assistant", "content": "1, 2,"}]  # fmt: skip
    prompt = (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nCount to five.<|im_end|>\n"
        "<|im_start|>assistant\n1, 2,"
    )
    out = _chat(client, messages, extra_body={"continue_final_message": True, "echo": True})
    assert out.usage.prompt_tokens == len(llm.tokenizer.encode(prompt))
    assert out.choices[0].message.content == "1, 2," + _complete(client, prompt)


REFUSED = [
    # extra fields -> the param the 400 names, the start of its message
    pytest.param({"tools": TOOLS}, "tools", "tools: this model's chat template does not read",
                 id="tools"),
    pytest.param({"tools": TOOLS, "tool_choice": "required"}, "tool_choice",
                 "tool_choice 'required' is not supported", id="tool-choice-required"),
    pytest.param({"tool_choice": "auto"}, "tool_choice", "tool_choice 'auto' needs tools",
                 id="tool-choice-without-tools"),
    pytest.param({"documents": [{"title": "a", "text": "b"}]}, "documents",
                 "documents: this model's chat template does not read", id="documents"),
    pytest.param({"chat_template_kwargs": {"enable_thinking": False}}, "chat_template_kwargs",
                 "chat_template_kwargs: this model's chat template does not read "
                 "'enable_thinking'", id="template-kwargs"),
    pytest.param({"continue_final_message": True, "add_generation_prompt": True},
                 "add_generation_prompt", "continue_final_message and add_generation_prompt",
                 id="continue-and-generation-prompt"),
    pytest.param({"messages": [*MESSAGES[:2], {"role": "assistant", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{"}}]}]},
        "messages.2.tool_calls", "messages.2.tool_calls: function arguments are not JSON",
        id="arguments-not-json"),
]  # fmt: skip


@pytest.mark.parametrize("fields, param, message", REFUSED)
def test_what_the_template_cannot_take_gets_a_400(client, fields, param, message):
    with pytest.raises(openai.BadRequestError) as refused:
        _chat(client, extra_body=fields)
    error = refused.value.body
    assert error["param"] == param
    assert error["message"].startswith(message), error["message"]
