"""A request's state inside the engine: its tokens, progress, blocks and outputs."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from engine.sampling_params import SamplingParams
from engine.stop import OutputText, StopReason
from engine.tokenizer import IncrementalDetokenizer

if TYPE_CHECKING:  # torch only for a type: StepOutput crosses into the torch-free router
    import torch
    from llguidance import LLMatcher

RequestStatus = Literal["waiting", "running", "awaiting_kv", "finished"]
FinishReason = Literal["stop", "length", "abort"]


@dataclass(slots=True)
class Request:
    """One progress model for every phase: KV exists for token_ids[:num_computed_tokens].

    A request needs a forward pass over token_ids[num_computed_tokens:]; the logits of its
    last token give the next token. Prefill, chunked prefill, decode and recompute after
    preemption are all this one rule.
    """

    request_id: str
    token_ids: list[int]  # prompt followed by the generated tokens
    num_prompt_tokens: int
    params: SamplingParams
    generator: torch.Generator | None
    detokenizer: IncrementalDetokenizer
    max_total_tokens: int  # the context limit: generation stops at it with reason "length"
    eos_token_id: int | None = None  # ends it (None with ignore_eos); min_tokens suppresses it
    logprobs: list[TokenLogprobs] = field(default_factory=list)  # per output token, if asked
    status: RequestStatus = "waiting"
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served by the prefix cache on first schedule
    # A prefill worker's fetch plan walked its prefix (plan_prefix_fetch) and counted that walk
    # in the tiers' lookup metrics: its first prefix match, which finds what the plan held,
    # counts nothing again.
    prefix_looked_up: bool = False
    block_ids: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)
    # The leading blocks of block_ids already registered in the prefix cache (or found there):
    # each step registers only the blocks it filled, not the whole table again.
    num_registered_blocks: int = 0
    finish_reason: FinishReason | None = None
    stop_reason: StopReason = None  # with finish_reason "stop": the stop string or token id
    output: OutputText = field(init=False)  # the text clients see (stop strings applied)
    num_preemptions: int = 0
    arrival_time_s: float = field(default_factory=time.monotonic)
    first_scheduled_time_s: float | None = None
    first_token_time_s: float | None = None
    # With params.structured_output: the grammar's state after every token so far.
    matcher: LLMatcher | None = None
    index: int = 0  # which of its request's params.n samples this is (sample 0: the request)
    # The prompt's last tokens that were output already: a request moved mid-stream from a
    # lost worker resumes from its prompt plus what that worker streamed.
    num_prior_output_tokens: int = 0

    def __post_init__(self) -> None:
        self.output = OutputText(self.detokenizer, num_tokens=self.num_prior_output_tokens)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def generated_token_ids(self) -> list[int]:
        """The output the output rules count (penalties, min_tokens, max_tokens): this
        engine's and, after a move, the tokens streamed before it."""
        return self.token_ids[self.num_prompt_tokens - self.num_prior_output_tokens :]

    @property
    def num_generated_tokens(self) -> int:
        return self.num_output_tokens + self.num_prior_output_tokens

    @property
    def text(self) -> str:
        return self.output.text

    @property
    def is_finished(self) -> bool:
        return self.status == "finished"

    def sampler_state(self) -> bytes:
        """The RNG state, to hand a seeded request over to another worker mid-stream."""
        return b"" if self.generator is None else self.generator.get_state().numpy().tobytes()


@dataclass(frozen=True, slots=True)
class TokenLogprobs:
    """A generated token's log-probability and the most likely tokens at its position: the
    model's log-softmax over the whole vocabulary in fp32, before any sampling option."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # (token id, logprob), most likely first


@dataclass(frozen=True, slots=True)
class RequestOutput:
    """What the offline API returns for one prompt (the shape vLLM users know)."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: FinishReason | None
    num_cached_tokens: int
    logprobs: list[TokenLogprobs] | None = None  # one per token id, with params.logprobs


@dataclass(frozen=True, slots=True)
class StepOutput:
    """What one engine step produced for one request: streaming needs only the delta."""

    request_id: str
    new_token_ids: list[int]
    text_delta: str
    num_computed_tokens: int
    finished: bool
    finish_reason: FinishReason | None
    stop_reason: StopReason = None
    logprobs: tuple[TokenLogprobs, ...] = ()  # for new_token_ids, with params.logprobs
    index: int = 0  # the request's sample (Request.index)


SAMPLE_MARK = "#"  # in a sample's request id only: no request's own id may contain it


def sample_ids(request_id: str, n: int) -> list[str]:
    """The engine request ids of a request's n samples, by index: sample 0 is the request."""
    return [request_id] + [f"{request_id}{SAMPLE_MARK}{i}" for i in range(1, n)]
