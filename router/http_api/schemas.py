"""OpenAI request bodies: parsing with errors a client can act on, and what they ask for."""

from __future__ import annotations

import json
from typing import Annotated, Any, ClassVar, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from engine import errors as engine_errors
from engine.grammar import grammar_of
from engine.sampling_params import MAX_N, GrammarKind, StructuredOutput
from router.errors import InvalidRequestError
from router.http_api import refused as refused_fields
from router.http_api.refused import Refused

UInt32 = Annotated[int, Field(ge=0, lt=1 << 32)]  # token ids travel as proto uint32
Finite = Annotated[float, Field(allow_inf_nan=False)]  # JSON's 1e400 parses as inf
M = TypeVar("M", bound=BaseModel)


class _Body(BaseModel):
    # Clients send vendor extension fields freely: unknown fields are ignored, not errors.
    model_config = ConfigDict(extra="ignore")
    # Documented fields this server does not honour: a 400 unless they ask for nothing.
    refused: ClassVar[tuple[Refused, ...]] = ()


class StreamOptions(_Body):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: the usage so far in every chunk


class JsonSchemaFormat(_Body):
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")  # BaseModel has a .schema
    strict: bool | None = None  # the output always follows the schema


class ResponseFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(_Body):
    """vLLM's structured_outputs (the guided_* fields' successor)."""

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_fallback: bool | None = None  # there is no fallback backend either way


class StructuredFields(_Body):
    """Structured output, in OpenAI's and vLLM's spellings: at most one constraint."""

    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    def structured_output(self) -> StructuredOutput | None:
        """The request's constraint, checked (a 400 naming the field that holds it)."""
        given = [(param, c) for param, c in self._constraints() if c is not None]
        if len(given) > 1:
            raise InvalidRequestError(
                f"one structured output constraint per request: {given[0][0]} and {given[1][0]}"
                " are both set", param=given[1][0],
            )  # fmt: skip
        if not given:
            return None
        param, constraint = given[0]
        try:
            grammar_of(constraint)
        except engine_errors.InvalidRequestError as e:
            raise InvalidRequestError(f"{param}: {e}", param=param) from e
        return constraint

    def _constraints(self) -> list[tuple[str, StructuredOutput | None]]:
        outputs = self.structured_outputs or StructuredOutputs()
        return [
            ("response_format", _response_format(self.response_format)),
            ("guided_json", _json_schema(self.guided_json)),
            ("guided_regex", _spec("regex", self.guided_regex)),
            ("guided_choice", _choice(self.guided_choice)),
            ("guided_grammar", _spec("grammar", self.guided_grammar)),
            ("structured_outputs.json", _json_schema(outputs.json_)),
            ("structured_outputs.regex", _spec("regex", outputs.regex)),
            ("structured_outputs.choice", _choice(outputs.choice)),
            ("structured_outputs.grammar", _spec("grammar", outputs.grammar)),
            ("structured_outputs.json_object",
             StructuredOutput("json_object") if outputs.json_object else None),
        ]  # fmt: skip


def _response_format(response_format: ResponseFormat | None) -> StructuredOutput | None:
    if response_format is None or response_format.type == "text":
        return None
    if response_format.type == "json_object":
        return StructuredOutput("json_object")
    if response_format.json_schema is None or response_format.json_schema.schema_ is None:
        raise InvalidRequestError("response_format json_schema needs json_schema.schema",
                                  param="response_format.json_schema")  # fmt: skip
    return _json_schema(response_format.json_schema.schema_)


def _json_schema(schema: dict[str, Any] | str | None) -> StructuredOutput | None:
    if schema is None:
        return None
    spec = schema if isinstance(schema, str) else json.dumps(schema)
    return StructuredOutput("json_schema", spec)


def _spec(kind: GrammarKind, spec: str | None) -> StructuredOutput | None:
    return None if spec is None else StructuredOutput(kind, spec)


def _choice(choices: list[str] | None) -> StructuredOutput | None:
    return None if choices is None else StructuredOutput("choice", json.dumps(choices))


class GenerationBody(StructuredFields):
    """The fields both APIs share (OpenAI names, plus vLLM's common extensions)."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: Finite | None = None
    top_p: Finite | None = None
    top_k: Annotated[int, Field(lt=1 << 32)] | None = None  # proto uint32; < 1 is the engine's
    seed: Annotated[int, Field(ge=0, lt=1 << 64)] | None = None
    n: Annotated[int, Field(ge=1, le=MAX_N)] | None = None  # choices, sample i seeded seed + i
    stop: str | list[str] | None = None
    stop_token_ids: list[UInt32] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    # vLLM's sampling options; the engine validates their ranges (SamplingParams).
    min_p: Finite | None = None
    presence_penalty: Finite | None = None
    frequency_penalty: Finite | None = None
    repetition_penalty: Finite | None = None
    min_tokens: UInt32 | None = None
    logit_bias: dict[UInt32, Finite] | None = None  # JSON keys are strings: "42" is token 42
    stream: bool = False
    stream_options: StreamOptions | None = None
    truncate_prompt_tokens: Annotated[int, Field(ge=1)] | None = None  # keep the last k tokens
    add_special_tokens: bool | None = None  # None: the endpoint's default (vLLM's)
    request_id: str | None = None  # vLLM's; X-Request-Id wins, as in vLLM
    # Who asks, for the log: OpenAI's end-user ids and request metadata.
    user: str | None = None
    safety_identifier: str | None = None
    metadata: dict[str, str] | None = None

    def sampling_fields(self) -> dict[str, Any]:
        """Only what the client set: the engine's defaults apply to the rest."""
        names = ("max_tokens", "temperature", "top_p", "top_k", "seed", "n", "stop",
                 "stop_token_ids", "min_p", "presence_penalty", "frequency_penalty",
                 "repetition_penalty", "min_tokens", "logit_bias")  # fmt: skip
        fields = {name: value for name in names if (value := getattr(self, name)) is not None}
        return fields | {
            "ignore_eos": self.ignore_eos,
            "include_stop_str_in_output": self.include_stop_str_in_output,
            "structured_output": self.structured_output(),
        }

    @field_validator("stop")
    @classmethod
    def _stop_is_unicode(cls, stop: str | list[str] | None) -> str | list[str] | None:
        # JSON escapes can spell lone surrogates, which no proto string (or UTF-8) can carry.
        for text in [stop] if isinstance(stop, str) else stop or []:
            try:
                text.encode("utf-8")
            except UnicodeEncodeError as e:
                raise ValueError(f"stop strings must be valid Unicode: {e.reason}") from e
        return stop

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def continuous_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.continuous_usage_stats

    def who(self) -> dict[str, object]:
        """The caller's own labels, for the request log."""
        fields = {"user": self.user, "safety_identifier": self.safety_identifier,
                  "metadata": self.metadata}  # fmt: skip
        return {name: value for name, value in fields.items() if value is not None}

    def truncate(self, prompt_token_ids: list[int]) -> list[int]:
        """vLLM's truncate_prompt_tokens: only the last k tokens of the prompt are kept."""
        k = self.truncate_prompt_tokens
        return prompt_token_ids if k is None else prompt_token_ids[-k:]


class CompletionBody(GenerationBody):
    refused = refused_fields.COMPLETION
    prompt: str | list[UInt32] | list[str] | list[list[UInt32]]
    echo: bool = False  # the prompt comes back in front of the completion
    logprobs: UInt32 | None = None  # this many alternatives per token (the engine checks <= 20)

    def sampling_fields(self) -> dict[str, Any]:
        fields = GenerationBody.sampling_fields(self)
        return fields if self.logprobs is None else fields | {"logprobs": self.logprobs}

    def single_prompt(self) -> str | list[int]:
        """One text or one token-id list (a batch of prompts would need n > 1 outputs)."""
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
            if len(prompt) != 1:
                raise InvalidRequestError(
                    f"{len(prompt)} prompts in one request: send one prompt", param="prompt"
                )
            return prompt[0]
        return prompt


class ContentPart(_Body):
    type: str
    text: str | None = None


class FunctionCall(_Body):
    name: str
    arguments: str  # JSON, as the model wrote it


class ToolCall(_Body):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # assistant: the calls it made
    tool_call_id: str | None = None  # tool: the call this answers

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        if any(part.type != "text" or part.text is None for part in self.content):
            raise InvalidRequestError("only text content parts are supported", param="messages")
        return "".join(part.text or "" for part in self.content)


class FunctionDefinition(_Body):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema
    strict: bool | None = None


class Tool(_Body):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Body):
    name: str


class NamedToolChoice(_Body):
    type: Literal["function"]
    function: NamedFunction


class ChatTemplateFields(_Body):
    """What the chat template gets (engine/chat_template.py), with vLLM's switches."""

    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    documents: list[dict[str, str]] | None = None
    reasoning_effort: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool | None = None  # None: true, unless continue_final_message
    continue_final_message: bool = False


class ChatBody(GenerationBody, ChatTemplateFields):
    refused = refused_fields.CHAT
    max_completion_tokens: int | None = None
    echo: bool = False  # a final assistant message comes back in front of the reply
    logprobs: bool = False
    top_logprobs: UInt32 | None = None  # alternatives per token, with logprobs

    def sampling_fields(self) -> dict[str, Any]:
        fields = GenerationBody.sampling_fields(self)
        if self.max_completion_tokens is not None:  # the newer name wins, as in OpenAI's API
            fields["max_tokens"] = self.max_completion_tokens
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidRequestError("top_logprobs needs logprobs: true", param="top_logprobs")
        if self.logprobs:
            fields["logprobs"] = self.top_logprobs or 0
        return fields


class TokenizeCompletionBody(_Body):
    """vLLM's /tokenize for a prompt."""

    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatBody(ChatTemplateFields):
    """vLLM's /tokenize for chat messages, rendered as /v1/chat/completions would."""

    refused = (refused_fields.CHAT_TEMPLATE,)
    model: str | None = None
    add_special_tokens: bool = False
    return_token_strs: bool = False


class DetokenizeBody(_Body):
    model: str | None = None
    tokens: list[UInt32]


def parse_tokenize(raw: bytes) -> TokenizeCompletionBody | TokenizeChatBody:
    """vLLM's two /tokenize shapes: messages make it a chat."""
    data = _json_object(raw)
    return _validate(data, TokenizeChatBody if "messages" in data else TokenizeCompletionBody)


def parse_body(raw: bytes, model: type[M]) -> M:
    return _validate(_json_object(raw), model)


def _json_object(raw: bytes) -> dict[str, Any]:
    try:
        data = json.loads(raw, parse_constant=_reject_constant)
    except UnicodeDecodeError as e:
        raise InvalidRequestError(
            f"request body is not valid UTF-8 (byte {e.start}: {e.reason})"
        ) from e
    except ValueError as e:  # JSONDecodeError, and NaN / Infinity
        raise InvalidRequestError(f"request body is not valid JSON: {e}") from e
    except RecursionError as e:
        raise InvalidRequestError("request body is nested too deeply") from e
    if not isinstance(data, dict):
        raise InvalidRequestError("request body must be a JSON object")
    return data


def _validate(data: dict[str, Any], model: type[M]) -> M:
    refused_fields.refuse(data, model.refused)
    try:
        return model.model_validate(data)
    except ValidationError as e:
        error = e.errors()[0]
        where = ".".join(str(part) for part in error["loc"])
        raise InvalidRequestError(f"{where}: {error['msg']}", param=where) from e


def _reject_constant(name: str) -> float:
    raise ValueError(f"{name} is not a JSON number")
