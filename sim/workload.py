"""Workloads: prompt/output length mixes and arrival processes (open-loop Poisson, bursts,
closed loop at a fixed concurrency), all drawn from one seeded generator."""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from typing import Literal

import numpy as np

Shape = Literal["prefill_mix", "sharegpt", "summarisation", "fixed"]


@dataclass(frozen=True, slots=True)
class SimRequest:
    request_id: str
    prompt_token_ids: list[int]
    max_tokens: int
    client: int = 0  # closed loop: which client sent it
    think_s: float = 0.0  # closed loop: the client pauses this long before sending it

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)


@dataclass(frozen=True, slots=True)
class LengthMix:
    """How long prompts and outputs are.

    prefill_mix: the published prefill-tuning mix, 70% short (64-256 tokens) and 30% long
      (1024-4096), uniform within each range (mean input 880: the study's "~1,580" cannot come
      from those ranges, whose largest possible mean is 1,408).
    sharegpt: lognormal prompts and outputs (chatbot; medians ~ ShareGPT's).
    summarisation: long lognormal prompts, short outputs (LongBench-like).
    fixed: every prompt prompt_tokens long (validation and tests).
    """

    shape: Shape = "prefill_mix"
    scale: float = 1.0  # prompt lengths are multiplied by this (small machines)
    output_tokens: tuple[int, int] = (32, 128)  # uniform, for prefill_mix and fixed
    prompt_tokens: int = 256  # fixed
    max_prompt_tokens: int = 7168
    vocab: tuple[int, int] = (1000, 40000)

    def draw(self, rng: random.Random) -> tuple[int, int]:
        """(prompt tokens, output tokens)."""
        if self.shape == "prefill_mix":
            low, high = (1024, 4096) if rng.random() < 0.3 else (64, 256)
            prompt, output = rng.randint(low, high), rng.randint(*self.output_tokens)
        elif self.shape == "sharegpt":
            prompt = int(rng.lognormvariate(5.5, 1.0))  # median ~245
            output = int(rng.lognormvariate(5.3, 0.9))  # median ~200
        elif self.shape == "summarisation":
            prompt = int(rng.lognormvariate(7.6, 0.5))  # median ~2,000
            output = int(rng.lognormvariate(4.6, 0.5))  # median ~100
        else:
            prompt, output = self.prompt_tokens, rng.randint(*self.output_tokens)
        prompt = max(1, min(self.max_prompt_tokens, round(prompt * self.scale)))
        return prompt, max(1, min(output, 2048))


@dataclass(slots=True)
class RequestSource:
    """An endless, reproducible stream of requests: random token ids, so no prefix is shared
    unless shared_prefix_tokens says so (a common system prompt)."""

    mix: LengthMix
    seed: int = 0
    shared_prefix_tokens: int = 0
    _count: int = 0
    _lengths: random.Random = field(init=False)
    _tokens: np.random.Generator = field(init=False)
    _prefix: list[int] = field(init=False)

    def __post_init__(self) -> None:
        self._lengths = random.Random(self.seed)
        self._tokens = np.random.default_rng(self.seed + 1_000_003)
        low, high = self.mix.vocab
        self._prefix = self._tokens.integers(low, high, self.shared_prefix_tokens).tolist()

    def next(self, client: int = 0) -> SimRequest:
        num_prompt, num_output = self.mix.draw(self._lengths)
        low, high = self.mix.vocab
        num_body = max(0, num_prompt - len(self._prefix))
        body = self._tokens.integers(low, high, num_body).tolist()
        prompt = (self._prefix + body)[:num_prompt] if self._prefix else body
        request = SimRequest(f"r{self._count:06d}", prompt, num_output, client)
        self._count += 1
        return request


@dataclass(frozen=True, slots=True)
class OpenLoop:
    """Poisson arrivals at rate_per_s for duration_s, plus optional bursts: at each burst time,
    burst_size requests of burst_mix arrive together."""

    rate_per_s: float
    duration_s: float
    bursts_s: tuple[float, ...] = ()
    burst_size: int = 0
    burst_mix: LengthMix | None = None

    def arrivals(self, source: RequestSource, seed: int) -> Iterator[tuple[float, SimRequest]]:
        rng = random.Random(seed + 7)
        events: list[tuple[float, int, SimRequest]] = []
        t = rng.expovariate(self.rate_per_s) if self.rate_per_s > 0 else self.duration_s
        while t < self.duration_s:
            events.append((t, len(events), source.next()))
            t += rng.expovariate(self.rate_per_s)
        if self.bursts_s:
            burst_source = RequestSource(self.burst_mix or source.mix, seed + 99)
            for when in self.bursts_s:
                for _ in range(self.burst_size):
                    request = burst_source.next()
                    tagged = SimRequest(f"b{len(events):06d}", request.prompt_token_ids,
                                        request.max_tokens)  # fmt: skip
                    events.append((when, len(events), tagged))
        for when, _, request in sorted(events, key=lambda e: (e[0], e[1])):
            yield when, request


@dataclass(frozen=True, slots=True)
class ClosedLoop:
    """concurrency clients, each sending its next request when the last one ended (after the
    request's own pause, SimRequest.think_s), until num_requests have been sent (or duration_s
    has passed)."""

    concurrency: int
    num_requests: int
    duration_s: float = float("inf")


@dataclass(frozen=True, slots=True)
class Conversations:
    """Multi-turn chat: every turn after the first sends the whole conversation so far (the
    earlier prompt, its reply, a new user message), so it shares its prefix with the turn
    before. Replies are drawn tokens, not the model's: a real run and the simulator send the
    same prompts, and the prefix a turn shares is the earlier turn's prompt and reply.

    A user reads and types before each turn (the first too): the client pauses a time drawn
    uniformly in think_s. Closed-loop clients that never pause fall into step with each other,
    so that which turns meet in the router's queue, and the TTFT median with it, depends on
    where the first seconds left them; the pauses keep them apart, as users are."""

    num_turns: int = 4
    first_tokens: tuple[int, int] = (128, 384)  # system prompt and first message, uniform
    user_tokens: tuple[int, int] = (16, 64)  # each later message
    output_tokens: int = 16  # every reply
    think_s: tuple[float, float] = (0.0, 1.0)
    vocab: tuple[int, int] = (1000, 40000)

    def draw(self, num_conversations: int, seed: int) -> list[list[SimRequest]]:
        """Each conversation's turns, in the order they are sent."""
        lengths = random.Random(seed)
        tokens = np.random.default_rng(seed + 1_000_003)
        pauses = random.Random(seed + 2_000_003)  # its own: the prompts do not depend on it
        conversations = []
        for c in range(num_conversations):
            history = tokens.integers(*self.vocab, lengths.randint(*self.first_tokens)).tolist()
            turns = []
            for t in range(self.num_turns):
                if t:
                    reply = tokens.integers(*self.vocab, self.output_tokens).tolist()
                    message = tokens.integers(*self.vocab, lengths.randint(*self.user_tokens))
                    history = history + reply + message.tolist()
                think_s = pauses.uniform(*self.think_s)
                turns.append(SimRequest(f"c{c:04d}-t{t}", history, self.output_tokens,
                                        think_s=think_s))  # fmt: skip
            conversations.append(turns)
        return conversations


class Sequential:
    """Hands out requests in a fixed order to closed-loop clients, the same in a real run as
    in the simulator. Given conversations, a client sends one conversation's turns in order
    (the next only after the last one's reply) and then takes the next conversation."""

    def __init__(self, conversations: list[list[SimRequest]]) -> None:
        self._waiting = list(conversations)
        self._current: dict[int, list[SimRequest]] = {}

    @classmethod
    def of(cls, requests: list[SimRequest]) -> Sequential:
        """Single requests, each its own one-turn conversation."""
        return cls([[request] for request in requests])

    def next(self, client: int = 0) -> SimRequest | None:
        """None: nothing left for this client (other clients may still have turns to send)."""
        turns = self._current.get(client)
        if not turns:
            if not self._waiting:
                return None
            turns = self._current[client] = list(self._waiting.pop(0))
        return replace(turns.pop(0), client=client)
