"""Chat templates: tool calls, tool results and names reach the template; what a template reads
is known from its source; continue_final_message; transformers' globals; compiled once."""

from __future__ import annotations

from dataclasses import replace

import pytest

from engine.chat_template import ChatTemplateError
from engine.tokenizer import TextTokenizer

MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris?", "name": "ann"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"id": "c1", "type": "function",
         "function": {"name": "weather", "arguments": {"city": "Paris"}}},
    ]},
    {"role": "tool", "content": "18 C", "tool_call_id": "c1"},
]  # fmt: skip
# A template of the kind tool-calling models ship: it reads tools, names, tool calls and ids,
# and an extra switch (enable_thinking) that chat_template_kwargs can set.
TOOL_TEMPLATE = (
    "{{ bos_token }}{% if tools %}<tools>{% for tool in tools %}{{ tool.function | tojson }}"
    "{% endfor %}</tools>\n{% endif %}"
    "{% for m in messages %}<{{ m.role }}{% if m.name %} name={{ m.name }}{% endif %}>"
    "{% for c in m.tool_calls or [] %}<call {{ c.id }}>{{ c.function.name }}"
    "{{ c.function.arguments | tojson }}</call>{% endfor %}{{ m.content }}"
    "{% if m.tool_call_id %} [{{ m.tool_call_id }}]{% endif %}{{ eos_token }}\n{% endfor %}"
    "{% if messages[0].role == 'tool' %}{{ raise_exception('a chat cannot open with a tool') }}"
    "{% endif %}{% if add_generation_prompt %}<assistant>"
    "{% if enable_thinking is defined and not enable_thinking %}{{ strftime_now('%%') }}"
    "{% endif %}{% endif %}"
)
TOOLS = [{"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}]


@pytest.fixture(scope="module")
def smollm(model_dir) -> TextTokenizer:
    return TextTokenizer.load(model_dir)


@pytest.fixture(scope="module")
def tool_model(smollm) -> TextTokenizer:
    return replace(smollm, chat_template=TOOL_TEMPLATE)


def test_smollm_renders_tool_calls_and_results_as_its_template_does(smollm):
    assert smollm.apply_chat_template(MESSAGES) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nWeather in Paris?<|im_end|>\n"
        "<|im_start|>assistant\n<|im_end|>\n"
        "<|im_start|>tool\n18 C<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    # Its template reads neither tools nor names: the router refuses tools for it.
    assert not smollm.chat().reads("tools")
    assert smollm.chat().variables == {"messages", "add_generation_prompt"}


def test_a_tool_template_gets_tools_names_calls_and_special_tokens(tool_model):
    text = tool_model.apply_chat_template(
        MESSAGES, variables={"tools": TOOLS, "enable_thinking": False}
    )
    assert text == (
        '<|im_start|><tools>{"name": "weather", "parameters": {"type": "object"}}</tools>\n'
        "<system>Be brief.<|im_end|>\n"
        "<user name=ann>Weather in Paris?<|im_end|>\n"
        '<assistant><call c1>weather{"city": "Paris"}</call><|im_end|>\n'
        "<tool>18 C [c1]<|im_end|>\n"
        "<assistant>%"
    )
    assert tool_model.chat().reads("tools") and tool_model.chat().reads("enable_thinking")
    assert tool_model.encode(text, add_special_tokens=False)[:2] == [1, 44]  # <|im_start|><


def test_raise_exception_in_a_template_is_a_chat_template_error(tool_model):
    with pytest.raises(ChatTemplateError, match="^a chat cannot open with a tool$"):
        tool_model.apply_chat_template([{"role": "tool", "content": "x"}])


def test_continue_final_message_ends_inside_the_last_message(smollm):
    messages = [{"role": "user", "content": "Count"}, {"role": "assistant", "content": "1, 2,"}]
    text = smollm.apply_chat_template(
        messages, add_generation_prompt=False, continue_final_message=True
    )
    assert text.endswith("<|im_start|>user\nCount<|im_end|>\n<|im_start|>assistant\n1, 2,")


def test_the_template_is_compiled_once(smollm):
    assert smollm.chat() is smollm.chat()
