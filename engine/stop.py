"""Stop rules and the text a client may see: EOS, stop token ids and stop strings, with text
held back while it could still be the start of a stop string.

The released text never contains a stop string or any part of one: a suffix of the output
text that is a proper prefix of some stop string is held until the next token shows whether
the stop completes (then it is cut) or not (then it is released). When the request ends for
another reason (EOS, a stop token, length), the held text is flushed.

The same code runs in the engine and in the router (which replays a migrated request's tokens
to continue its text exactly), so the text depends only on the token ids and the params.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.sampling_params import SamplingParams
from engine.tokenizer import IncrementalDetokenizer

StopReason = str | int | None  # vLLM's: the stop string, the stop token id, None for EOS


@dataclass(frozen=True, slots=True)
class StopHit:
    """A stop rule matched; reason is what matched (None: EOS)."""

    reason: StopReason


@dataclass(slots=True)
class OutputText:
    """One request's output text as clients see it."""

    detokenizer: IncrementalDetokenizer
    num_sent_chars: int = 0  # of `text`, already released to the client
    num_tokens: int = 0  # generated tokens seen; none can stop the request before min_tokens
    stopped_text: str | None = None  # the detokenized text cut at a stop string

    @property
    def text(self) -> str:
        return self.detokenizer.text if self.stopped_text is None else self.stopped_text

    def add(self, token_id: int, params: SamplingParams, eos_token_id: int) -> StopHit | None:
        """Detokenizes one generated token and applies the stop rules to it."""
        self.num_tokens += 1
        can_stop = self.num_tokens >= params.min_tokens  # vLLM's rule, stop strings included
        is_eos = can_stop and token_id == eos_token_id and not params.ignore_eos
        is_stop_token = can_stop and token_id in params.stop_token_ids
        if not (is_eos or is_stop_token) or params.include_stop_str_in_output:
            num_before = len(self.detokenizer.text)
            self.detokenizer.add(token_id)
            num_new = len(self.detokenizer.text) - num_before
        else:
            num_new = 0  # a stop token's own text is not output
        if is_eos:
            return StopHit(None)
        if is_stop_token:
            return StopHit(token_id)
        if not (params.stop and can_stop):
            return None
        match = find_stop(self.detokenizer.text, num_new, params.stop)
        if match is None:
            return None
        start, stop = match
        end = start + len(stop) if params.include_stop_str_in_output else start
        self.stopped_text = self.detokenizer.text[:end]
        return StopHit(stop)

    def release(self, params: SamplingParams, finished: bool) -> str:
        """The text delta the client may see now: all of it once finished, else all but a
        suffix that could still begin a stop string."""
        text = self.text
        end = len(text)
        if not finished and not params.include_stop_str_in_output:
            # With the stop string included, text up to the match is output anyway.
            end -= num_held_chars(text, params.stop)
        end = max(end, self.num_sent_chars)
        delta = text[self.num_sent_chars : end]
        self.num_sent_chars = end
        return delta


def find_stop(text: str, num_new_chars: int, stops: tuple[str, ...]) -> tuple[int, str] | None:
    """The earliest stop string in text that ends in its last num_new_chars characters:
    (start index, the stop string). Earliest start, so no part of any stop is kept."""
    if num_new_chars <= 0:
        return None
    longest = max(len(s) for s in stops)
    start = max(0, len(text) - num_new_chars - longest + 1)
    hits = [(i, s) for s in stops if (i := text.find(s, start)) != -1]
    return min(hits, key=lambda hit: hit[0]) if hits else None


def num_held_chars(text: str, stops: tuple[str, ...]) -> int:
    """Length of the longest suffix of text that is a proper prefix of a stop string."""
    if not stops:
        return 0
    longest = max(len(s) for s in stops)
    for size in range(min(longest - 1, len(text)), 0, -1):
        tail = text[-size:]
        if any(s.startswith(tail) for s in stops):
            return size
    return 0
