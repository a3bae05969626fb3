"""Request migration: when a decode worker is lost mid-request, the request continues on
another one from its prompt plus the tokens already streamed, and the router carries the text
on itself, so the client sees one uninterrupted stream.

The new worker detokenizes from the first token it generates: it cannot know a character whose
bytes started before the move, nor text held back as the possible start of a stop string. So
after a move the router is the text's authority: it replays the streamed tokens through the
engine's own text code (engine.stop.OutputText, a function of the token ids and the params
only), which leaves it in exactly the state the lost worker was in, and feeds it the new
worker's tokens.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from engine import SamplingParams
from engine.stop import OutputText
from engine.tokenizer import IncrementalDetokenizer, TextTokenizer
from pdserve import grpc_convert
from pdserve.v1 import generation_pb2 as pb

log = logging.getLogger(__name__)


@dataclass(slots=True)
class ResumedText:
    """The text of a moved request, continued as the uninterrupted stream would have it."""

    params: SamplingParams
    eos_token_id: int
    output: OutputText

    @classmethod
    def replay(
        cls, tokenizer: TextTokenizer, params: SamplingParams, output_token_ids: list[int],
        num_sent_chars: int,
    ) -> ResumedText:  # fmt: skip
        resumed = cls(params, tokenizer.eos_token_id, OutputText(IncrementalDetokenizer(tokenizer)))
        for token_id in output_token_ids:
            resumed.output.add(token_id, params, tokenizer.eos_token_id)
            resumed.output.release(params, finished=False)
        if resumed.output.num_sent_chars != num_sent_chars:  # a worker on other code or model
            log.warning("replayed text has %d characters released, the client got %d",
                        resumed.output.num_sent_chars, num_sent_chars)  # fmt: skip
            resumed.output.num_sent_chars = num_sent_chars
        return resumed

    def rewrite(self, message: pb.GenerateResponse) -> pb.GenerateResponse:
        """The new worker's message with the text (and the stop) the uninterrupted stream would
        carry; a stop string that spans the move ends the request here, tokens after it cut."""
        out = pb.GenerateResponse(request_id=message.request_id)
        hit = None
        for token_id in message.token_ids:
            out.token_ids.append(token_id)
            hit = self.output.add(token_id, self.params, self.eos_token_id)
            if hit is not None:
                break
        out.logprobs.extend(message.logprobs[: len(out.token_ids)])
        if hit is not None:
            out.finish_reason = "stop"
            grpc_convert.set_stop_reason(out, hit.reason)
        elif message.finish_reason:
            out.finish_reason = message.finish_reason
            grpc_convert.set_stop_reason(out, grpc_convert.stop_reason_of(message))
        out.text = self.output.release(self.params, finished=bool(out.finish_reason))
        return out
