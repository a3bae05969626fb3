"""Stop strings: never a stop string or any part of one in the text, also when it spans
several tokens, streaming (engine step deltas) and whole; stop_reason; include_stop_str_in_output;
held text flushed when the request ends for another reason."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import pytest

from engine import SamplingParams
from engine.stop import find_stop, num_held_chars

PROMPT = "The three most common colours of a rainbow are"
MAX_TOKENS = 24
_ids = itertools.count()


@dataclass(frozen=True, slots=True)
class Run:
    token_ids: list[int]
    deltas: list[str]  # one per step output
    finish_reason: str | None
    stop_reason: str | int | None

    @property
    def text(self) -> str:
        return "".join(self.deltas)


def stream(llm, params: SamplingParams) -> Run:
    """One request through engine steps, as a decode worker streams it."""
    engine = llm.engine
    rid = f"stop-{next(_ids)}"
    engine.add_request(rid, PROMPT, params)
    token_ids, deltas = [], []
    while True:
        outputs = [o for o in engine.step() if o.request_id == rid]
        for output in outputs:
            token_ids += output.new_token_ids
            deltas.append(output.text_delta)
            if output.finished:
                assert engine.pool.num_free_blocks == engine.pool.num_blocks
                return Run(token_ids, deltas, output.finish_reason, output.stop_reason)


def greedy(**fields: object) -> SamplingParams:
    return SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, **fields)


@pytest.fixture(scope="module")
def reference(llm) -> Run:
    run = stream(llm, greedy())
    assert len(run.token_ids) == MAX_TOKENS and run.finish_reason == "length"
    return run


def spanning_stop(pieces: list[str], num_tokens: int) -> tuple[str, int, int]:
    """A stop string that starts inside one token's text and ends inside the text of the token
    num_tokens - 1 later, occurring first there: (stop, its start in the text, the index of
    the token that completes it)."""
    text = "".join(pieces)
    offsets = list(itertools.accumulate(len(p) for p in pieces))
    for first in range(len(pieces) - num_tokens + 1):
        span = pieces[first : first + num_tokens]
        if len(span[0]) < 2 or len(span[-1]) < 2 or not all(span):
            continue
        start = offsets[first] - 1  # the first token's last character
        stop = text[start : offsets[first + num_tokens - 2] + 1]  # ... the last one's first
        if text.find(stop) == start:
            return stop, start, first + num_tokens - 1
    raise AssertionError(f"no stop string spans {num_tokens} tokens of {pieces}")


@pytest.mark.parametrize("num_tokens", [2, 3])
@pytest.mark.parametrize("include", [False, True])
def test_a_stop_string_across_tokens_is_cut_exactly(llm, reference, num_tokens, include):
    stop, start, last = spanning_stop(reference.deltas, num_tokens)
    run = stream(llm, greedy(stop=["never in this text \x00", stop],
                             include_stop_str_in_output=include))  # fmt: skip
    end = start + len(stop) if include else start
    assert run.text == reference.text[:end]
    assert run.token_ids == reference.token_ids[: last + 1]
    assert (run.finish_reason, run.stop_reason) == ("stop", stop)
    whole = llm.generate([PROMPT], greedy(stop=stop, include_stop_str_in_output=include))[0]
    assert (whole.text, whole.token_ids) == (run.text, run.token_ids)


def test_held_text_is_flushed_when_the_request_ends_by_length(llm, reference):
    # A stop that begins with the text's last characters but never completes: they are held
    # back on the way and released with the last message.
    tail = reference.text[-2:]
    run = stream(llm, greedy(stop=[tail + "\x00never"]))
    assert run.text == reference.text
    assert run.deltas[-1].endswith(tail)
    assert (run.finish_reason, run.stop_reason) == ("length", None)


def test_the_earliest_of_several_stop_strings_wins(llm, reference):
    late, late_start, _ = spanning_stop(reference.deltas, 3)
    early = reference.text[2:5]
    assert reference.text.find(early) < late_start
    run = stream(llm, greedy(stop=[late, early]))
    assert run.text == reference.text[: reference.text.find(early)]
    assert run.stop_reason == early


@pytest.mark.parametrize("include", [False, True])
def test_a_stop_token_id_is_the_stop_reason(llm, reference, include):
    index = next(i for i, d in enumerate(reference.deltas) if i >= 3 and d.strip())
    token = reference.token_ids[index]
    run = stream(llm, greedy(stop_token_ids=[token], include_stop_str_in_output=include))
    assert run.token_ids == reference.token_ids[: index + 1]
    kept = reference.deltas[: index + 1] if include else reference.deltas[:index]
    assert run.text == "".join(kept)
    assert (run.finish_reason, run.stop_reason) == ("stop", token)


FIND_CASES = [
    # text, number of new characters, stops -> (start, stop) or None
    ("hello world", 3, ("wor",), (6, "wor")),
    ("hello world", 2, ("hello",), None),  # ended before the new text: found earlier
    ("abcabc", 1, ("c", "bc"), (4, "bc")),  # earliest start: nothing of a stop remains
    ("abc", 0, ("c",), None),
]


@pytest.mark.parametrize("text, num_new, stops, expected", FIND_CASES)
def test_find_stop(text, num_new, stops, expected):
    assert find_stop(text, num_new, stops) == expected


HELD_CASES = [
    # text, stops -> characters held back
    ("the end", ("ending",), 3),
    ("the end", ("xyz",), 0),
    ("aa", ("aab",), 2),
    ("the end", ("d", "nd!"), 2),
    ("", ("abc",), 0),
]


@pytest.mark.parametrize("text, stops, expected", HELD_CASES)
def test_num_held_chars(text, stops, expected):
    assert num_held_chars(text, stops) == expected
