"""Structured output in the engine: one llguidance matcher per constrained request, advanced
with every token the request accepts (engine/llm_engine.py), and the sampler's mask stage:
the constrained rows' allowed-token bitmask, applied to their logits before anything picks."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from llguidance import LLMatcher, LLTokenizer
from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask

from engine.errors import InvalidRequestError
from engine.grammar import grammar_of
from engine.sampling_params import StructuredOutput
from engine.tokenizer import TextTokenizer

if TYPE_CHECKING:
    from engine.request import Request


class Grammars:
    """Builds each constrained request's matcher; owns llguidance's view of the vocabulary
    (built on the first constrained request: about a second)."""

    def __init__(self, tokenizer: TextTokenizer, vocab_size: int) -> None:
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size  # the logits' width, which the bitmask must cover
        self._ll_tokenizer: LLTokenizer | None = None

    def matcher(self, constraint: StructuredOutput) -> LLMatcher:
        matcher = LLMatcher(self._vocabulary(), grammar_of(constraint), log_level=0)
        if matcher.is_error():
            raise InvalidRequestError(f"invalid {constraint.kind}: {matcher.get_error()}")
        return matcher

    def _vocabulary(self) -> LLTokenizer:
        if self._ll_tokenizer is None:
            self._ll_tokenizer = LLTokenizer(
                self._tokenizer.hf.to_str(), n_vocab=self._vocab_size,
                eos_token=self._tokenizer.eos_token_id,
            )  # fmt: skip
        return self._ll_tokenizer


@torch.inference_mode()
def apply_grammar_masks(logits: torch.Tensor, requests: Sequence[Request]) -> None:
    """The sampler's first stage: a constrained row keeps only the tokens its grammar allows
    next (the rest become -inf, which no later stage can lift)."""
    rows = [i for i, r in enumerate(requests) if r.matcher is not None]
    if not rows:
        return
    vocab = logits.shape[1]
    bitmask = allocate_token_bitmask(len(rows), vocab)  # [m, ceil(vocab / 32)] int32, host
    for j, i in enumerate(rows):
        fill_next_token_bitmask(requests[i].matcher, bitmask, j)
    allowed = _unpack(torch.from_numpy(bitmask).to(logits.device), vocab)  # [m, vocab]
    index = torch.tensor(rows, dtype=torch.int64, device=logits.device)
    # logits[index], not index_select, as in the sampler (engine/sampling.py says why).
    masked = logits[index].masked_fill_(~allowed, float("-inf"))
    logits.index_copy_(0, index, masked)


def _unpack(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """[m, words] int32, bit b of word w for token 32 w + b -> [m, vocab] bool."""
    bits = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    return ((bitmask.unsqueeze(-1) >> bits) & 1).bool().flatten(1)[:, :vocab]
