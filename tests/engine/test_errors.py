"""Bad input raises a typed error with a clear message; nothing leaks, the engine keeps going."""

from __future__ import annotations

import pytest

from engine import (
    LLM,
    EngineConfig,
    InvalidRequestError,
    PromptTooLongError,
    SamplingParams,
    UnknownModelError,
)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_tokens": 0}, "max_tokens must be at least 1, got 0"),
        ({"max_tokens": -3}, "max_tokens must be at least 1, got -3"),
        ({"top_p": 0.0}, r"top_p must be in \(0, 1\], got 0.0"),
        ({"top_p": 1.5}, r"top_p must be in \(0, 1\], got 1.5"),
        ({"temperature": -1.0}, "temperature must be >= 0, got -1.0"),
        ({"top_k": 0}, "top_k must be at least 1"),
    ],
)
def test_bad_sampling_params(kwargs, message):
    with pytest.raises(InvalidRequestError, match=message):
        SamplingParams(**kwargs)


def test_bad_prompts_fail_the_call_and_leave_the_engine_serving(llm):
    engine = llm.engine
    with pytest.raises(InvalidRequestError, match="prompt is empty"):
        llm.generate(["fine prompt", ""])
    with pytest.raises(InvalidRequestError, match="prompt is empty"):
        llm.generate([[]])
    too_long = [42] * engine.max_model_len
    with pytest.raises(PromptTooLongError, match=f"prompt has {engine.max_model_len} tokens"):
        llm.generate([too_long])
    with pytest.raises(InvalidRequestError, match=r"prompt token ids \[49152\] are outside"):
        llm.generate([[1, 49152]])
    assert engine.requests == {}
    assert engine.pool.num_free_blocks == engine.pool.num_blocks
    out = llm.generate(["Hello"], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    assert len(out[0].token_ids) == 3


def test_unknown_model_names_the_choices():
    with pytest.raises(UnknownModelError, match=r"unknown model 'no-such-model': give one of"):
        LLM(model="no-such-model")


def test_chunk_size_outside_the_supported_range():
    with pytest.raises(InvalidRequestError, match=r"chunk_size must be in \[128, 2048\], got 64"):
        LLM(chunk_size=64)


def test_a_negative_step_overhead_is_refused():
    message = r"step_overhead_tokens must be an integer >= 0, got -2"
    with pytest.raises(InvalidRequestError, match=message):
        EngineConfig(device="cpu", step_overhead_tokens=-2)


def test_generation_stops_at_the_context_limit():
    llm = LLM(num_threads=2, device="cpu", num_blocks=4)  # 64 token slots
    out = llm.generate([[42] * 60], SamplingParams(max_tokens=50, temperature=0.0))
    assert out[0].finish_reason == "length"
    assert len(out[0].token_ids) == 4
