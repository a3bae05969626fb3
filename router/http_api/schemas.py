"""OpenAI request bodies: parsing with errors a client can act on, and what they ask for."""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from router.errors import InvalidRequest

UInt32 = Annotated[int, Field(ge=0, lt=1 << 32)]  # token ids travel as proto uint32
Finite = Annotated[float, Field(allow_inf_nan=False)]  # JSON's 1e400 parses as inf
M = TypeVar("M", bound=BaseModel)


class _Body(BaseModel):
    # Clients send vendor extension fields freely: unknown fields are ignored, not errors.
    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Body):
    include_usage: bool = False


class GenerationBody(_Body):
    """The sampling fields both APIs share (OpenAI names, plus vLLM's common extensions)."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: Finite | None = None
    top_p: Finite | None = None
    top_k: Annotated[int, Field(lt=1 << 32)] | None = None  # proto uint32; < 1 is the engine's
    seed: Annotated[int, Field(ge=0, lt=1 << 64)] | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[UInt32] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None

    def sampling_fields(self) -> dict[str, Any]:
        """Only what the client set: the engine's defaults apply to the rest."""
        names = ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stop_token_ids")
        fields = {name: value for name in names if (value := getattr(self, name)) is not None}
        return fields | {
            "ignore_eos": self.ignore_eos,
            "include_stop_str_in_output": self.include_stop_str_in_output,
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

    def check_supported(self) -> None:
        """Known OpenAI options this server cannot honour are refused, never silently dropped."""
        if self.n != 1:
            raise InvalidRequest(f"n={self.n} is not supported: send n=1", param="n")
        for name, value in self._unsupported().items():
            if value:
                raise InvalidRequest(f"{name} is not supported by this server", param=name)

    def _unsupported(self) -> dict[str, object]:
        return {}


class CompletionBody(GenerationBody):
    prompt: str | list[UInt32] | list[str] | list[list[UInt32]]
    echo: bool = False
    logprobs: int | None = None
    best_of: int | None = None
    suffix: str | None = None

    def _unsupported(self) -> dict[str, object]:
        best_of = self.best_of is not None and self.best_of != 1
        return {"echo": self.echo, "logprobs": self.logprobs is not None, "best_of": best_of,
                "suffix": self.suffix}  # fmt: skip

    def single_prompt(self) -> str | list[int]:
        """One text or one token-id list (a batch of prompts would need n > 1 outputs)."""
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
            if len(prompt) != 1:
                raise InvalidRequest(
                    f"{len(prompt)} prompts in one request: send one prompt", param="prompt"
                )
            return prompt[0]
        return prompt


class ContentPart(_Body):
    type: str
    text: str | None = None


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        if any(part.type != "text" or part.text is None for part in self.content):
            raise InvalidRequest("only text content parts are supported", param="messages")
        return "".join(part.text or "" for part in self.content)


class ChatBody(GenerationBody):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None

    def _unsupported(self) -> dict[str, object]:
        return {"logprobs": self.logprobs, "top_logprobs": self.top_logprobs is not None}

    def sampling_fields(self) -> dict[str, Any]:
        fields = GenerationBody.sampling_fields(self)
        if self.max_completion_tokens is not None:  # the newer name wins, as in OpenAI's API
            fields["max_tokens"] = self.max_completion_tokens
        return fields

    def template_messages(self) -> list[dict[str, str]]:
        return [{"role": m.role, "content": m.text()} for m in self.messages]


def parse_body(raw: bytes, model: type[M]) -> M:
    try:
        data = json.loads(raw, parse_constant=_reject_constant)
    except UnicodeDecodeError as e:
        raise InvalidRequest(f"request body is not valid UTF-8 (byte {e.start}: {e.reason})") from e
    except ValueError as e:  # JSONDecodeError, and NaN / Infinity
        raise InvalidRequest(f"request body is not valid JSON: {e}") from e
    except RecursionError as e:
        raise InvalidRequest("request body is nested too deeply") from e
    if not isinstance(data, dict):
        raise InvalidRequest("request body must be a JSON object")
    try:
        return model.model_validate(data)
    except ValidationError as e:
        error = e.errors()[0]
        where = ".".join(str(part) for part in error["loc"])
        raise InvalidRequest(f"{where}: {error['msg']}", param=where) from e


def _reject_constant(name: str) -> float:
    raise ValueError(f"{name} is not a JSON number")
