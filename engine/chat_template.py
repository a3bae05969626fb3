"""Chat templates: compiled once per source, the variables a template reads, and rendering
with the globals Hugging Face templates expect. Torch-free (the router renders chats)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from functools import lru_cache
from typing import Any

from jinja2 import Template, TemplateError, meta
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

# Set by rendering itself: a chat_template_kwargs entry may not replace them.
RESERVED = frozenset({"messages", "add_generation_prompt", "bos_token", "eos_token"})


class ChatTemplateError(ValueError):
    """The model has no chat template, or the messages do not fit it."""


@dataclass(frozen=True, slots=True)
class ChatTemplate:
    template: Template
    # The free variables of the source (jinja2.meta): a template "supports" tools when it
    # reads `tools`, documents when it reads `documents`, and so on.
    variables: frozenset[str]
    bos_token: str
    eos_token: str

    def reads(self, name: str) -> bool:
        return name in self.variables

    def render(
        self, messages: list[dict[str, Any]], *, add_generation_prompt: bool = True,
        continue_final_message: bool = False, variables: Mapping[str, Any] | None = None,
    ) -> str:  # fmt: skip
        """variables: the template's optional inputs (tools, documents, chat_template_kwargs).
        continue_final_message: the text ends inside the last message, for the model to go
        on with it (the template's end-of-message markup after it is cut, as transformers
        does)."""
        try:
            text = self.template.render(
                {
                    **(variables or {}),
                    "messages": messages,
                    "add_generation_prompt": add_generation_prompt,
                    "bos_token": self.bos_token,
                    "eos_token": self.eos_token,
                }  # fmt: skip
            )
        except ChatTemplateError:  # the template's own raise_exception
            raise
        except Exception as e:  # a template error is the caller's message shape, never a crash
            raise ChatTemplateError(f"chat template failed on these messages: {e}") from e
        return _cut_after_final(text, messages) if continue_final_message else text


@lru_cache(maxsize=8)
def compile_template(source: str, bos_token: str, eos_token: str) -> ChatTemplate:
    """Parsing and compiling once per template, not per request."""
    # What transformers gives templates: {% break %} / {% continue %}, JSON without HTML
    # escaping, raise_exception, strftime_now, and the special tokens' text.
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = _strftime_now
    try:
        parsed = env.parse(source)
    except TemplateError as e:
        raise ChatTemplateError(f"the chat template does not parse: {e}") from e
    variables = frozenset(meta.find_undeclared_variables(parsed)) - set(env.globals)
    return ChatTemplate(env.from_string(parsed), variables, bos_token, eos_token)


def _cut_after_final(text: str, messages: list[dict[str, Any]]) -> str:
    final = str(messages[-1].get("content") or "").strip()
    end = text.rfind(final) if final else -1
    if end < 0:
        raise ChatTemplateError(
            "continue_final_message: the final message's content is not in the rendered chat"
        )
    return text[: end + len(final)]


def _tojson(
    value: Any, ensure_ascii: bool = False, indent: int | None = None,
    separators: tuple[str, str] | None = None, sort_keys: bool = False,
) -> str:  # fmt: skip
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)  # fmt: skip


def _raise(message: str) -> None:
    raise ChatTemplateError(message)


def _strftime_now(format_: str) -> str:
    return datetime.now().strftime(format_)
