"""OpenAI response shapes: whole responses, stream chunks (SSE), usage and error bodies."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from engine.stop import StopReason
from pdserve.v1 import generation_pb2 as pb
from router.errors import RouterError, Status

Kind = Literal["completion", "chat"]


def usage_json(usage: pb.Usage) -> dict[str, Any]:
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_prompt_tokens},
    }


def error_body(
    message: str, type_: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def error_json(error: RouterError, status: Status) -> dict[str, Any]:
    return error_body(error.message, status.openai_type, error.param, error.code)


# Characters that Python's str.splitlines() ends a line at and JSON leaves unescaped: a client
# that reads the stream with it (httpx's aiter_lines, and so guidellm) would cut an event in two
# where a generated token holds one. Written as JSON escapes, they read back the same.
_LINE_BREAKS_JSON_KEEPS = str.maketrans({c: f"\\u{ord(c):04x}" for c in "\x85\u2028\u2029"})


def sse(data: dict[str, Any]) -> bytes:
    text = json.dumps(data, ensure_ascii=False).translate(_LINE_BREAKS_JSON_KEEPS)
    return f"data: {text}\n\n".encode()


SSE_DONE = b"data: [DONE]\n\n"
MIN_LOGPROB = -9999.0  # JSON has no -inf: vLLM's floor for a token the model rules out


@dataclass(slots=True)
class Logprobs:
    """One request's OpenAI logprobs objects, run of tokens after run of tokens. token_text:
    one token's text (special tokens included, a partial UTF-8 character as U+FFFD, as vLLM
    shows them)."""

    kind: Kind
    token_text: Callable[[int], str]
    text_offset: int = 0  # completions: where the next token's text starts in the text

    def json(self, logprobs: Sequence[pb.TokenLogprobs]) -> dict[str, Any]:
        if self.kind == "chat":
            return {"content": [self._chat_entry(lp) for lp in logprobs]}
        tokens, offsets = [], []
        for lp in logprobs:
            offsets.append(self.text_offset)
            tokens.append(self.token_text(lp.sampled.token_id))
            self.text_offset += len(tokens[-1])
        return {
            "tokens": tokens,
            "token_logprobs": [_floor(lp.sampled.logprob) for lp in logprobs],
            # The k most likely, and the sampled token when it is not among them (vLLM's).
            "top_logprobs": [
                {self.token_text(t.token_id): _floor(t.logprob) for t in [*lp.top, lp.sampled]}
                for lp in logprobs
            ],
            "text_offset": offsets,
        }

    def _chat_entry(self, lp: pb.TokenLogprobs) -> dict[str, Any]:
        return self._chat_token(lp.sampled) | {
            "top_logprobs": [self._chat_token(t) for t in lp.top]
        }

    def _chat_token(self, lp: pb.Logprob) -> dict[str, Any]:
        text = self.token_text(lp.token_id)
        return {"token": text, "logprob": _floor(lp.logprob), "bytes": list(text.encode())}


def _floor(logprob: float) -> float:
    return max(logprob, MIN_LOGPROB)


@dataclass(frozen=True, slots=True)
class Responder:
    """Builds one request's responses, in the completions or the chat shape; choice i is
    sample i of the request's n."""

    kind: Kind
    request_id: str
    model: str
    logprobs: tuple[Logprobs, ...] = ()  # one per choice, when the request asks for them
    created: int = field(default_factory=lambda: int(time.time()))

    def choice(
        self, index: int, text: str, finish_reason: str, stop_reason: StopReason,
        logprobs: dict[str, Any] | None = None,
    ) -> dict[str, Any]:  # fmt: skip
        """A whole response's choice. stop_reason is vLLM's: the stop string or token id that
        ended it (None for EOS)."""
        if self.kind == "chat":
            choice = {"index": index, "message": {"role": "assistant", "content": text}}
        else:
            choice = {"index": index, "text": text}
        return choice | {
            "logprobs": logprobs, "finish_reason": finish_reason, "stop_reason": stop_reason
        }  # fmt: skip

    def response(self, choices: list[dict[str, Any]], usage: pb.Usage) -> dict[str, Any]:
        object_ = "chat.completion" if self.kind == "chat" else "text_completion"
        return self._envelope(object_, choices) | {"usage": usage_json(usage)}

    def chunk(
        self, text: str, finish_reason: str | None, stop_reason: StopReason = None, *,
        index: int = 0, first: bool = False, logprobs: dict[str, Any] | None = None,
    ) -> dict[str, Any]:  # fmt: skip
        if self.kind == "chat":
            delta: dict[str, str] = {"role": "assistant"} if first else {}
            if text or first:
                delta["content"] = text
            choice: dict[str, Any] = {"index": index, "delta": delta}
        else:
            choice = {"index": index, "text": text}
        choice |= {"logprobs": logprobs, "finish_reason": finish_reason, "stop_reason": stop_reason}
        return self._envelope(self._chunk_object, [choice])

    def usage_chunk(self, usage: pb.Usage) -> dict[str, Any]:
        """The extra last chunk that stream_options.include_usage asks for."""
        return self._envelope(self._chunk_object, []) | {"usage": usage_json(usage)}

    @property
    def _chunk_object(self) -> str:
        return "chat.completion.chunk" if self.kind == "chat" else "text_completion"

    def _envelope(self, object_: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        prefix = "chatcmpl" if self.kind == "chat" else "cmpl"
        return {
            "id": f"{prefix}-{self.request_id}",
            "object": object_,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }
