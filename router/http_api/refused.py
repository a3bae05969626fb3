"""Documented OpenAI / vLLM request fields this server does not honour: a request that sets
one to anything but a value that asks for nothing gets a 400 naming it, never a silent 200.

Fields that nobody documents are still ignored (clients send vendor extensions freely); the
table in docs/router.md lists every documented field, honoured or refused, and
tests/router/test_router_fields.py keeps it and these tuples in step.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from router.errors import InvalidRequestError


@dataclass(frozen=True, slots=True)
class Refused:
    name: str  # dotted for a nested field: "stream_options.include_obfuscation"
    why: str
    no_op: tuple[object, ...] = (None,)  # the values that ask for nothing (the defaults)


_MISSING = object()

# Sampling options the sampler does not have yet.
SAMPLING = (
    Refused("use_beam_search", "no beam search", (None, False)),
    Refused("length_penalty", "only beam search uses it", (None, 1)),
    Refused("allowed_token_ids", "no per-request token mask"),
    Refused("bad_words", "no per-request token mask", (None, [])),
    Refused("prompt_logprobs", "prompt logprobs are not computed"),
    Refused("return_tokens_as_token_ids", "logprobs name tokens by their text", (None, False)),
    Refused("return_token_ids", "responses carry text only", (None, False)),
    Refused("skip_special_tokens", "special tokens are always skipped", (None, True)),
    Refused("spaces_between_special_tokens", "special tokens are always skipped", (None, True)),
)
# Server-side features this server does not have.
SERVER = (
    Refused("logits_processors", "no server-side logits processors", (None, [])),
    Refused("cache_salt", "the prefix cache is not salted per request"),
    Refused("kv_transfer_params", "pdserve moves KV between its own workers itself"),
    Refused("vllm_xargs", "no custom extensions"),
    Refused("priority", "no priority scheduling: requests queue by prompt length", (None, 0)),
    Refused("stream_options.include_obfuscation", "stream chunks are not padded", (None, False)),
    Refused("service_tier", "one service tier", (None, "auto", "default")),
    Refused("store", "completions are not stored", (None, False)),
    Refused("prompt_cache_key", "prefix-cache routing keys on the prompt's own tokens"),
    Refused("prompt_cache_retention", "the prefix cache lives in KV memory", (None, "in-memory")),
)
STRUCTURED = (
    Refused("guided_whitespace_pattern", 'JSON is written with ", " and ": " only'),
    Refused("guided_decoding_backend", "one backend: llguidance"),
    Refused("structural_tag", "no structural tags"),
    Refused("structured_outputs.structural_tag", "no structural tags"),
    Refused("structured_outputs.whitespace_pattern", 'JSON is written with ", " and ": " only'),
    Refused(
        "structured_outputs.disable_any_whitespace",
        'JSON separators are ", " and ": "',
        (None, False),
    ),
    Refused(
        "structured_outputs.disable_additional_properties",
        "schemas are taken as written",
        (None, False),
    ),
)
# A request's own template would run the caller's code (loops included) in the router.
CHAT_TEMPLATE = Refused("chat_template", "only the model's own chat template")
COMPLETION = (
    *SAMPLING, *SERVER, *STRUCTURED,
    Refused("best_of", "no ranking of samples, as in vLLM V1: send n", (None, 1)),
    Refused("suffix", "the model has no fill-in-the-middle template", (None, "")),
    Refused("prompt_embeds", "prompts are text or token ids"),
)  # fmt: skip
CHAT = (
    *SAMPLING, *SERVER, *STRUCTURED,
    Refused("parallel_tool_calls", "tool calls are not parsed from the output", (None, True)),
    Refused("functions", "deprecated by OpenAI: send tools"),
    Refused("function_call", "deprecated by OpenAI: send tool_choice"),
    Refused("audio", "text output only"),
    Refused("modalities", "text output only", (None, ["text"])),
    Refused("prediction", "no predicted outputs"),
    Refused("web_search_options", "no web search"),
    Refused("verbosity", "no chat template takes a verbosity"),
    Refused("include_reasoning", "no reasoning parser splits it from the content", (None, True)),
    Refused("mm_processor_kwargs", "text-only model"),
    CHAT_TEMPLATE,
)  # fmt: skip


def refuse(data: dict[str, Any], refused: Iterable[Refused]) -> None:
    """Raises InvalidRequestError for the first refused field the request sets to a value that
    asks for something."""
    for field in refused:
        value = _lookup(data, field.name)
        if value is not _MISSING and not _is_no_op(value, field.no_op):
            raise InvalidRequestError(
                f"{field.name} is not supported by this server ({field.why})", param=field.name
            )


def _is_no_op(value: object, no_op: tuple[object, ...]) -> bool:
    # bool is an int in Python: True must not pass for 1, nor False for 0.
    return any(value == v and isinstance(value, bool) == isinstance(v, bool) for v in no_op)


def _lookup(data: dict[str, Any], dotted: str) -> object:
    value: object = data
    for part in dotted.split("."):
        if not isinstance(value, dict) or part not in value:
            return _MISSING
        value = value[part]
    return value
