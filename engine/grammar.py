"""Structured output constraints as llguidance grammars, built and validated once per
constraint. Torch-free: the router checks a request's constraint before admitting it, and the
workers build their matchers from the same grammar text."""

from __future__ import annotations

import json
from functools import lru_cache

from llguidance import LLMatcher

from engine.errors import InvalidRequestError
from engine.sampling_params import StructuredOutput

# JSON written the way models write it (", " and ": "), and no free whitespace elsewhere: a
# free whitespace run is a place where a small model can loop until max_tokens.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@lru_cache(maxsize=256)
def grammar_of(constraint: StructuredOutput) -> str:
    """The llguidance grammar for a constraint, or InvalidRequestError saying what is wrong
    with it (an invalid schema, regex, choice list or grammar)."""
    grammar = _build(constraint)
    is_error, messages = LLMatcher.validate_grammar_with_warnings(grammar)
    if is_error:
        raise InvalidRequestError(f"invalid {constraint.kind}: {messages[0]}")
    return grammar


def _build(constraint: StructuredOutput) -> str:
    kind, spec = constraint.kind, constraint.spec
    if kind == "choice":
        return LLMatcher.grammar_from_lark(_choice_lark(spec))
    try:
        if kind == "json_schema":
            return LLMatcher.grammar_from_json_schema(spec, overrides=JSON_OPTIONS)
        if kind == "json_object":
            return LLMatcher.grammar_from_json_schema('{"type": "object"}', overrides=JSON_OPTIONS)
        if kind == "regex":
            return LLMatcher.grammar_from_regex(spec)
        return LLMatcher.grammar_from_lark(spec)
    except ValueError as e:  # not JSON at all
        raise InvalidRequestError(f"invalid {kind}: {e}") from e


def _choice_lark(spec: str) -> str:
    try:
        choices = json.loads(spec)
    except ValueError:
        choices = None
    valid = isinstance(choices, list) and all(isinstance(c, str) and c for c in choices)
    if not valid or not choices:
        raise InvalidRequestError("invalid choice: send a list of non-empty strings")
    # Lark string literals take JSON's escapes.
    return "start: " + " | ".join(json.dumps(choice) for choice in choices)
