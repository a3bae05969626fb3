"""What a chat request gives the model's chat template: the messages as Hugging Face templates
read them, the optional inputs the template supports (tools, documents, reasoning effort,
chat_template_kwargs: a 400 naming the field for one it does not read), and vLLM's switches."""

from __future__ import annotations

import json
from typing import Any

from engine.chat_template import RESERVED, ChatTemplate
from router.errors import InvalidRequestError
from router.http_api.schemas import ChatBody, ChatMessage, ChatTemplateFields, NamedToolChoice


def template_options(body: ChatTemplateFields, template: ChatTemplate) -> dict[str, Any]:
    """ChatTemplate.render's keyword arguments for this request."""
    if body.continue_final_message and body.add_generation_prompt:
        raise InvalidRequestError(
            "continue_final_message and add_generation_prompt cannot both be true: the reply "
            "either continues the final message or starts a new one", param="add_generation_prompt",
        )  # fmt: skip
    return {
        "add_generation_prompt": not body.continue_final_message
        if body.add_generation_prompt is None
        else body.add_generation_prompt,
        "continue_final_message": body.continue_final_message,
        "variables": _optional_inputs(body, template) | _template_kwargs(body, template),
    }


def template_messages(body: ChatTemplateFields) -> list[dict[str, Any]]:
    return [_message(message, i) for i, message in enumerate(body.messages)]


def echo_prefix(body: ChatBody) -> str:
    """vLLM's chat echo: a final assistant message comes back in front of the reply (which,
    with continue_final_message, goes on from it)."""
    final = body.messages[-1]
    return final.text() if body.echo and final.role == "assistant" else ""


def _optional_inputs(body: ChatTemplateFields, template: ChatTemplate) -> dict[str, Any]:
    tools = [tool.model_dump(exclude_none=True) for tool in body.tools or []] or None
    choice = body.tool_choice
    if choice is not None and choice != "none":
        if tools is None:
            raise InvalidRequestError(
                f"tool_choice {_name(choice)} needs tools", param="tool_choice"
            )
        if choice != "auto":  # "required" or a named function: the output would be forced
            raise InvalidRequestError(
                f"tool_choice {_name(choice)} is not supported: the model's output is not "
                "constrained to a tool call; send \"auto\" or \"none\"", param="tool_choice",
            )  # fmt: skip
    inputs = {"tools": tools, "documents": body.documents or None,
              "reasoning_effort": body.reasoning_effort}  # fmt: skip
    for name, value in inputs.items():
        if value is not None and not template.reads(name):
            raise InvalidRequestError(
                f"{name}: this model's chat template does not read `{name}`", param=name
            )
    return {name: value for name, value in inputs.items() if value is not None}


def _template_kwargs(body: ChatTemplateFields, template: ChatTemplate) -> dict[str, Any]:
    kwargs = body.chat_template_kwargs or {}
    for key in kwargs:
        if key in RESERVED:
            raise InvalidRequestError(f"chat_template_kwargs: {key!r} is set by the request itself",
                                      param="chat_template_kwargs")  # fmt: skip
        if not template.reads(key):
            raise InvalidRequestError(
                f"chat_template_kwargs: this model's chat template does not read {key!r}",
                param="chat_template_kwargs",
            )
    return kwargs


def _message(message: ChatMessage, index: int) -> dict[str, Any]:
    fields: dict[str, Any] = {"role": message.role, "content": message.text()}
    if message.name is not None:
        fields["name"] = message.name
    if message.tool_call_id is not None:
        fields["tool_call_id"] = message.tool_call_id
    if message.tool_calls:
        fields["tool_calls"] = [
            {
                "id": call.id,
                "type": call.type,
                "function": {
                    "name": call.function.name,
                    "arguments": _arguments(
                        call.function.arguments, f"messages.{index}.tool_calls"
                    ),
                },
            }  # fmt: skip
            for call in message.tool_calls
        ]
    return fields


def _arguments(arguments: str, param: str) -> Any:
    # Templates iterate over the arguments or write them with tojson: they get the decoded
    # object, as vLLM gives them.
    try:
        return json.loads(arguments)
    except ValueError as e:
        raise InvalidRequestError(
            f"{param}: function arguments are not JSON: {e}", param=param
        ) from e


def _name(choice: str | NamedToolChoice) -> str:
    return repr(choice) if isinstance(choice, str) else f"function {choice.function.name!r}"
