"""A moved request's text (router/migration.py), with the real tokenizer: whatever token the
move falls on, the client's text is exactly the uninterrupted stream's, also when the move
splits a multi-byte character or a stop string held back in part."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from engine import SamplingParams
from engine.stop import OutputText, StopReason
from engine.tokenizer import IncrementalDetokenizer, TextTokenizer
from pdserve import grpc_convert
from pdserve.v1 import generation_pb2 as pb
from router.migration import ResumedText

TEXT = "Café au lait ☕ costs 3€ — 日本語 is fun 😀, isn't it?"


@dataclass(frozen=True, slots=True)
class Stream:
    deltas: list[str]  # one per token, up to the one that finished it
    finish_reason: str
    stop_reason: StopReason


@pytest.fixture(scope="module")
def tokenizer(model_dir) -> TextTokenizer:
    return TextTokenizer.load(model_dir)


@pytest.fixture(scope="module")
def token_ids(tokenizer) -> list[int]:
    ids = tokenizer.encode(TEXT)
    # Byte-level BPE splits some of these characters over tokens: the case that matters.
    assert any(tokenizer.decode([t]).endswith("\ufffd") for t in ids)
    return ids


def uninterrupted(tokenizer: TextTokenizer, token_ids: list[int], params) -> Stream:
    """What one engine streams for these tokens (the last one ends it by length)."""
    output = OutputText(IncrementalDetokenizer(tokenizer))
    deltas = []
    for i, token_id in enumerate(token_ids):
        hit = output.add(token_id, params, tokenizer.eos_token_id)
        finished = hit is not None or i == len(token_ids) - 1
        deltas.append(output.release(params, finished))
        if hit is not None:
            return Stream(deltas, "stop", hit.reason)
    return Stream(deltas, "length", None)


def moved_after(tokenizer, token_ids, params, want: Stream, num_streamed: int) -> Stream:
    """The same request lost after num_streamed tokens and continued by another worker,
    whose own text (which cannot know what came before) the router replaces."""
    sent = want.deltas[:num_streamed]
    resumed = ResumedText.replay(
        tokenizer, params, token_ids[:num_streamed], sum(len(d) for d in sent)
    )
    deltas = list(sent)
    for i in range(num_streamed, len(token_ids)):
        message = pb.GenerateResponse(token_ids=[token_ids[i]], text="\ufffdworker's own")
        if i == len(token_ids) - 1:
            message.finish_reason = "length"
        out = resumed.rewrite(message)
        deltas.append(out.text)
        if out.finish_reason:
            return Stream(deltas, out.finish_reason, grpc_convert.stop_reason_of(out))
    raise AssertionError("the moved stream never finished")


STOPS = [
    pytest.param((), False, id="no-stop"),
    pytest.param(("€ — 日",), False, id="stop-across-multibyte"),
    pytest.param(("fun 😀",), True, id="stop-included"),
    pytest.param(("日本語 is dull", "isn't"), False, id="held-then-released"),
]


@pytest.mark.parametrize("stops, include", STOPS)
def test_a_move_at_any_token_gives_the_uninterrupted_text(tokenizer, token_ids, stops, include):
    params = SamplingParams(max_tokens=len(token_ids), stop=stops,
                            include_stop_str_in_output=include)  # fmt: skip
    want = uninterrupted(tokenizer, token_ids, params)
    if stops:
        assert want.finish_reason == "stop" and want.stop_reason == stops[-1]
    for num_streamed in range(len(want.deltas)):
        got = moved_after(tokenizer, token_ids, params, want, num_streamed)
        assert got == want, f"moved after {num_streamed} tokens"
