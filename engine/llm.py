"""The offline API, the way vLLM users know it: LLM(model=...).generate(prompts, params)."""

from __future__ import annotations

import itertools
from dataclasses import fields

from engine.config import EngineConfig
from engine.errors import InvalidRequestError
from engine.llm_engine import LLMEngine
from engine.request import RequestOutput
from engine.sampling_params import SamplingParams

_ids = itertools.count()


class LLM:
    def __init__(self, model: str = "smollm2-135m", **engine_args: object) -> None:
        known = {f.name for f in fields(EngineConfig)}
        unknown = sorted(set(engine_args) - known)
        if unknown:
            raise TypeError(f"unknown engine arguments {unknown}; known: {sorted(known)}")
        self.engine = LLMEngine(EngineConfig(model=model, **engine_args))

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: str | list[str] | list[list[int]],
        params: SamplingParams | list[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Runs all prompts batched; returns outputs in prompt order. Every prompt is validated
        before any runs, so a bad one fails the call without leaving work behind."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params_list = (
            params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
        )
        if len(params_list) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params_list)} sampling params")
        if any(p.n > 1 for p in params_list):  # one output per prompt
            raise InvalidRequestError("LLM.generate returns one sample per prompt: n must be 1")
        requests = [
            self.engine.make_request(f"offline-{next(_ids)}", prompt, p)
            for prompt, p in zip(prompts, params_list, strict=True)
        ]
        for request in requests:
            self.engine.enqueue(request)
        while any(not r.is_finished for r in requests):
            self.engine.step()
        return [
            RequestOutput(
                request_id=r.request_id,
                prompt_token_ids=r.prompt_token_ids,
                token_ids=r.output_token_ids,
                text=r.text,
                finish_reason=r.finish_reason,
                num_cached_tokens=r.num_cached_tokens,
                logprobs=None if r.params.logprobs is None else r.logprobs,
            )
            for r in requests
        ]
