"""The engine: validates requests, runs scheduler -> model runner steps, applies stop rules."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine.block_pool import BlockPool
from engine.config import EngineConfig, ModelConfig
from engine.errors import (
    EngineBusyError,
    InsufficientKVError,
    InvalidRequestError,
    PromptTooLongError,
)
from engine.kv_cache_manager import KVCacheManager
from engine.model_files import resolve_model
from engine.model_runner import ModelRunner
from engine.request import SAMPLE_MARK, FinishReason, Request, StepOutput, TokenLogprobs, sample_ids
from engine.sampling import make_generator
from engine.sampling_params import SamplingParams
from engine.scheduler import ScheduledRequest, Scheduler
from engine.structured_output import Grammars
from engine.tokenizer import IncrementalDetokenizer, TextTokenizer

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class EngineStats:
    """The live load a worker publishes to the registry."""

    num_queued_tokens: int
    num_running_requests: int
    num_waiting_requests: int
    num_free_blocks: int
    num_blocks: int
    num_quarantined_blocks: int
    prefix_hit_rate: float  # prompt tokens served by either KV tier / prompt tokens
    prefill_tokens_per_s: float
    host_load_s_per_token: float  # a token's KV from the host tier (0: none or unmeasured)


class LLMEngine:
    def __init__(
        self, config: EngineConfig, *, model_config: ModelConfig | None = None,
        tokenizer: TextTokenizer | None = None, runner: ModelRunner | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:  # fmt: skip
        """model_config, tokenizer and runner, given together, replace what would be loaded
        from config.model: the cluster simulator (sim/) passes a cost-model runner with the
        same execute() and a virtual clock, so everything else here runs as in a worker."""
        self.config = config
        self.clock = clock  # stamps request times and times steps
        if runner is None:
            self.model_dir = resolve_model(config.model)
            model_config = ModelConfig.from_dir(self.model_dir)
            tokenizer = TextTokenizer.load(self.model_dir)
            runner = ModelRunner(config, model_config, self.model_dir)
        assert model_config is not None and tokenizer is not None, "a runner needs both"
        self.model_config, self.tokenizer, self.runner = model_config, tokenizer, runner
        self.pool = BlockPool(config.num_blocks, config.enable_prefix_caching)
        self.tier = (
            runner.host_tier(config.kv_offload_bytes, config.kv_offload_path)
            if config.kv_offload_gb > 0
            else None
        )
        self.kv = KVCacheManager(self.pool, config.block_size, self.tier)
        self.scheduler = Scheduler(config, self.kv)
        self.requests: dict[str, Request] = {}
        self.grammars = Grammars(tokenizer, model_config.vocab_size)
        # The context: the model's positions, and never more than the whole pool can hold, so
        # a request alone always fits and preemption can never loop.
        self.max_model_len = min(
            config.max_model_len or self.model_config.max_position_embeddings,
            self.model_config.max_position_embeddings,
            config.num_blocks * config.block_size,
        )
        self._prefill_tokens_per_s = 0.0
        # Called on the engine thread after a step computed KV for a request, before any of its
        # blocks can be freed: the prefill worker ships finished blocks from here.
        self.on_computed: Callable[[Request], None] | None = None

    @property
    def kv_cache(self) -> torch.Tensor:
        return self.runner.kv_cache

    # ---- requests -------------------------------------------------------------------------
    def make_request(
        self, request_id: str, prompt: str | list[int], params: SamplingParams, index: int = 0,
        num_prior_output_tokens: int = 0,
    ) -> Request:  # fmt: skip
        """Validates and builds a request without queueing it (typed errors on bad input);
        index > 0: a sample the engine forks (sample_ids names it). num_prior_output_tokens:
        the prompt's last tokens are the output of a request moved here mid-stream, which the
        output rules count as output (params are the request's own, max_tokens included)."""
        if request_id in self.requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        if index == 0 and SAMPLE_MARK in request_id:  # no request can take a sample's id
            raise InvalidRequestError(
                f"request id {request_id!r} contains {SAMPLE_MARK!r}, which names samples"
            )
        token_ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if not token_ids:
            raise InvalidRequestError("prompt is empty")
        vocab = self.model_config.vocab_size
        bad = [t for t in token_ids if not 0 <= t < vocab]
        if bad:
            raise InvalidRequestError(f"prompt token ids {bad[:5]} are outside [0, {vocab})")
        if len(token_ids) >= self.max_model_len:
            raise PromptTooLongError(len(token_ids), self.max_model_len)
        bad = [t for t in params.logit_bias if t >= vocab]
        if bad:
            raise InvalidRequestError(f"logit_bias token ids {bad[:5]} are outside [0, {vocab})")
        _check_prior_output(num_prior_output_tokens, len(token_ids), params)
        num_prior = num_prior_output_tokens
        constraint = params.structured_output
        return Request(
            request_id=request_id,
            token_ids=token_ids,
            num_prompt_tokens=len(token_ids),
            params=params,
            generator=make_generator(params, self.config.device, num_prior),
            detokenizer=IncrementalDetokenizer(self.tokenizer),
            max_total_tokens=min(
                self.max_model_len, len(token_ids) - num_prior + params.max_tokens
            ),
            eos_token_id=None if params.ignore_eos else self.tokenizer.eos_token_id,
            arrival_time_s=self.clock(),
            matcher=None if constraint is None else self.grammars.matcher(constraint),
            index=index,
            num_prior_output_tokens=num_prior,
        )

    def add_request(
        self, request_id: str, prompt: str | list[int], params: SamplingParams,
        num_prior_output_tokens: int = 0,
    ) -> Request:  # fmt: skip
        return self.enqueue(self.make_request(
            request_id, prompt, params, num_prior_output_tokens=num_prior_output_tokens
        ))  # fmt: skip

    def enqueue(self, request: Request) -> Request:
        """Queues a request built by make_request."""
        self.requests[request.request_id] = request
        self.scheduler.add(request)
        return request

    def abort_request(self, request_id: str) -> None:
        request = self.requests.get(request_id)
        if request is not None:
            self._finish(request, "abort")

    # ---- remote prefill (the decode worker's side of disaggregation) ------------------------
    def reserve_for_remote_prefill(
        self, request_id: str, prompt: list[int], params: SamplingParams,
        num_prior_output_tokens: int = 0,
    ) -> Request:  # fmt: skip
        """Allocates blocks for a prompt whose KV another worker computes. Blocks already in the
        prefix cache are reused; the rest (request.block_ids[num_cached // block_size:]) must
        be written by the sender before commit_remote_prefill. Refuses (EngineBusyError) what
        the scheduler would not admit either: past max_num_seqs, or past the watermark."""
        num_seqs = len(self.scheduler.running) + self._num_awaiting_kv()
        # Its n samples all join the batch; an idle engine takes any n (the rest queue).
        if num_seqs > 0 and num_seqs + params.n > self.config.max_num_seqs:
            samples = f"; its {params.n} samples would pass it" if params.n > 1 else ""
            raise EngineBusyError(
                f"{num_seqs} requests are running or awaiting KV; max_num_seqs is "
                f"{self.config.max_num_seqs}{samples}"
            )
        request = self.make_request(
            request_id, prompt, params, num_prior_output_tokens=num_prior_output_tokens
        )
        request.num_cached_tokens = self.kv.match_prefix(request)
        num_new_blocks = self.kv.num_new_blocks_needed(request, request.num_prompt_tokens)
        limit = self.scheduler.watermark_limit()
        if num_seqs > 0 and self.pool.num_used_blocks + num_new_blocks > limit:
            self.kv.free(request)
            raise EngineBusyError(
                f"prompt needs {num_new_blocks} KV blocks; {self.pool.num_used_blocks} of "
                f"{self.pool.num_blocks} are in use and new work may fill {limit} (watermark "
                f"{self.config.watermark})"
            )
        if not self.kv.allocate_slots(request, request.num_prompt_tokens):
            self.kv.free(request)
            raise InsufficientKVError(num_new_blocks, self.pool.num_free_blocks)
        request.status = "awaiting_kv"
        self.requests[request_id] = request
        return request

    def replace_remote_blocks(self, request_id: str) -> list[int]:
        """Before a retry whose previous writer could not be fenced: quarantines the blocks it
        may still write into and gives the request fresh ones; returns the quarantined ids."""
        request = self.requests[request_id]
        assert request.status == "awaiting_kv", request.status
        return self.kv.replace_remote_blocks(request)

    def abort_remote_prefill(self, request_id: str, writer_fenced: bool) -> list[int]:
        """Ends a request awaiting remote KV. Unless its writer was fenced, the blocks it may
        still write into are quarantined rather than freed; returns their ids."""
        request = self.requests.get(request_id)
        if request is None or request.status != "awaiting_kv":
            self.abort_request(request_id)
            return []
        quarantined = [] if writer_fenced else self.kv.quarantine_remote_blocks(request)
        self._finish(request, "abort")
        return quarantined

    def _num_awaiting_kv(self) -> int:
        return sum(1 for r in self.requests.values() if r.status == "awaiting_kv")

    def commit_remote_prefill(
        self, request_id: str, first_token_id: int, sampler_state: bytes = b"",
        first_logprobs: TokenLogprobs | None = None,
    ) -> StepOutput:  # fmt: skip
        """The prompt's KV has landed: append the first token and join the decode batch.
        sampler_state (the sender's RNG state after sampling the first token) makes a seeded
        request continue exactly as it would in one process; first_logprobs are the first
        token's, when the request asks for logprobs."""
        request = self.requests[request_id]
        if first_logprobs is not None and request.params.logprobs is not None:
            request.logprobs.append(first_logprobs)
        assert request.status == "awaiting_kv", request.status
        if sampler_state and request.generator is not None:
            state = torch.frombuffer(bytearray(sampler_state), dtype=torch.uint8)
            request.generator.set_state(state)
        request.num_computed_tokens = request.num_prompt_tokens
        request.first_scheduled_time_s = request.arrival_time_s
        self.kv.cache_computed_blocks(request)
        self.scheduler.add_running(request)
        return self._append_token(request, first_token_id)

    # ---- prefix fetch (the prefill worker's side of cross-worker prefix reuse) --------------
    def reserve_prefix_fetch(self, num_blocks: int) -> list[int] | None:
        """A peer holds more of a prompt than our cache (claimed: kv.claim_prefix): allocates
        num_blocks for the next ones, None past the watermark. The caller fills them from the
        peer, registers them (kv.cache_prompt_blocks) and releases them and the claimed ones
        (kv.release) once the request has ended: held until then, they are the hits its
        prefix match finds."""
        return self.kv.reserve_prefix_fetch(num_blocks, self.scheduler.watermark_limit())

    # ---- the step ---------------------------------------------------------------------------
    def has_unfinished_requests(self) -> bool:
        return bool(self.scheduler.running or self.scheduler.waiting)

    def step(self) -> list[StepOutput]:
        batch = self.scheduler.schedule()
        if not batch:
            return []
        start = self.clock()
        for item in batch:
            if item.request.first_scheduled_time_s is None:
                item.request.first_scheduled_time_s = start
        next_tokens = self.runner.execute(batch)
        self._record_prefill_speed(batch, self.clock() - start)
        outputs = []
        for item in batch:
            request = item.request
            request.num_computed_tokens += item.num_new_tokens
            self.kv.cache_computed_blocks(request)
            if self.on_computed is not None:
                self.on_computed(request)
            token = next_tokens.get(request.request_id)
            if token is not None:
                outputs.append(self._append_token(request, token))
            else:
                outputs.append(_progress(request))
        return outputs

    def _append_token(self, request: Request, token_id: int) -> StepOutput:
        if request.first_token_time_s is None:
            request.first_token_time_s = self.clock()
        request.token_ids.append(token_id)
        if request.num_output_tokens == 1 and request.params.n > 1:
            self._fork(request)
        params = request.params
        hit = request.output.add(token_id, params, self.tokenizer.eos_token_id)
        if request.matcher is not None:
            request.matcher.consume_token(token_id)
        reason: FinishReason | None = None
        if hit is not None:
            reason, request.stop_reason = "stop", hit.reason
        elif request.matcher is not None and request.matcher.is_stopped():
            reason = "stop"  # the grammar is complete: nothing but EOS could follow
        elif request.num_tokens >= request.max_total_tokens:
            reason = "length"
        if reason is not None:
            self._finish(request, reason)
        # Text that may begin a stop string is held back until the request ends.
        delta = request.output.release(params, finished=reason is not None)
        return StepOutput(
            request_id=request.request_id,
            new_token_ids=[token_id],
            text_delta=delta,
            num_computed_tokens=request.num_computed_tokens,
            finished=request.is_finished,
            finish_reason=request.finish_reason,
            stop_reason=request.stop_reason,
            logprobs=tuple(request.logprobs[-1:]) if request.params.logprobs is not None else (),
            index=request.index,
        )

    def _fork(self, request: Request) -> None:
        """Sample 0's prompt KV is computed (and its full blocks cached, before this first
        token): samples 1..n-1 queue for the same prompt and hit the prefix cache for every
        full block, recomputing at most the last one, each with its own RNG stream."""
        prompt, params = request.prompt_token_ids, request.params
        samples = sample_ids(request.request_id, params.n)[1:]
        for index, sample_id in enumerate(samples, start=1):
            self.enqueue(self.make_request(sample_id, prompt, params.sample(index), index))

    def _finish(self, request: Request, reason: FinishReason) -> None:
        if request.is_finished:
            return
        self.scheduler.remove(request)
        self.kv.free(request)
        request.status = "finished"
        request.finish_reason = reason
        self.requests.pop(request.request_id, None)

    def _record_prefill_speed(self, batch: list[ScheduledRequest], seconds: float) -> None:
        num_prefill = sum(i.num_new_tokens for i in batch if i.num_new_tokens > 1)
        if num_prefill >= 64:  # tiny steps measure overhead, not throughput
            speed = num_prefill / max(seconds, 1e-9)
            rate = self._prefill_tokens_per_s
            self._prefill_tokens_per_s = speed if rate == 0 else 0.8 * rate + 0.2 * speed
            self.kv.prefill_s_per_token = 1 / self._prefill_tokens_per_s

    def stats(self) -> EngineStats:
        return EngineStats(
            num_queued_tokens=self.scheduler.num_queued_tokens,
            num_running_requests=len(self.scheduler.running),
            num_waiting_requests=len(self.scheduler.waiting),
            num_free_blocks=self.pool.num_free_blocks,
            num_blocks=self.pool.num_blocks,
            num_quarantined_blocks=len(self.kv.quarantined),
            prefix_hit_rate=self.kv.stats.hit_rate,
            prefill_tokens_per_s=self._prefill_tokens_per_s,
            host_load_s_per_token=(
                self.tier.load_s_per_block / self.config.block_size if self.tier else 0.0
            ),
        )


def _progress(request: Request) -> StepOutput:
    return StepOutput(
        request.request_id, [], "", request.num_computed_tokens, False, None, index=request.index
    )


def _check_prior_output(num_prior: int, num_prompt: int, params: SamplingParams) -> None:
    """A moved request's output before the move: the tail of its prompt, one sample, short
    of max_tokens (else nothing was left to generate)."""
    if num_prior == 0:
        return
    if not 0 < num_prior < min(num_prompt, params.max_tokens):
        raise InvalidRequestError(
            f"num_prior_output_tokens must be in [0, {min(num_prompt, params.max_tokens)}) "
            f"(the prompt's {num_prompt} tokens and max_tokens {params.max_tokens}), got "
            f"{num_prior}"
        )
    if params.n > 1:
        raise InvalidRequestError(
            f"a request with output before a move has one sample, not n={params.n}"
        )
