"""End to end through real processes: Redis + prefill + decode, for each KV transfer backend."""

from __future__ import annotations

import time

import pytest

from engine import SamplingParams
from tests.workers.calls import LONG_PROMPT, generate, token_ids


@pytest.fixture(scope="module")
def reference(llm):
    """Greedy tokens of the single-process engine."""

    def run(prompt_ids: list[int], max_tokens: int) -> list[int]:
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        return llm.generate([prompt_ids], params)[0].token_ids

    return run


def test_tokens_equal_the_single_process_engine(cluster, llm, reference):
    prefill, decode = cluster.workers
    short = llm.tokenizer.encode("The capital of France is")
    long = llm.tokenizer.encode(LONG_PROMPT)
    assert len(long) > 1200  # three chunks of 512, shipped as they finish
    for prompt in (short, long):
        messages = generate(
            decode.address, prompt, prefill.address, max_tokens=8, temperature=0.0,
            ignore_eos=True,
        )  # fmt: skip
        assert token_ids(messages) == reference(prompt, 8)
        final = messages[-1]
        assert final.finish_reason == "length"
        assert (final.usage.prompt_tokens, final.usage.completion_tokens) == (len(prompt), 8)
        assert messages[0].ttft.prefill_compute_s > 0
    load = cluster.load(decode)
    assert load.free_blocks == load.total_blocks


def test_a_shared_prefix_transfers_only_the_missing_blocks(cluster, llm):
    prefill, decode = cluster.workers
    bytes_per_block = 30 * 2 * 16 * 3 * 64 * 4  # layers * (K, V) * block * kv heads * dim * fp32
    backend = cluster.kv_backend
    sent = lambda: prefill.metric(  # noqa: E731
        "pdserve_kv_transfer_bytes_total", backend=backend, direction="sent"
    )
    report = " ".join(f"Line {i}: sensor {i % 7} read {i * 3} degrees." for i in range(120))
    shared = llm.tokenizer.encode(report)[:640]  # 40 full blocks, seen by no earlier test
    first = shared + llm.tokenizer.encode(" Question one: how many crates?")
    second = shared + llm.tokenizer.encode(" Question two: which day was busiest?")

    before = sent()
    generate(decode.address, first, prefill.address, max_tokens=2, temperature=0.0)
    after_first = sent()
    assert after_first - before == -(-len(first) // 16) * bytes_per_block

    generate(decode.address, second, prefill.address, max_tokens=2, temperature=0.0)
    # The decode worker still caches the 40 shared blocks: only the rest crosses the wire.
    assert sent() - after_first == (-(-len(second) // 16) - 40) * bytes_per_block


def test_a_decode_worker_asked_to_prefill_computes_the_prompt_itself(cluster, llm, reference):
    """DecodeRequest.prefill_here (the router's prefill overflow): the engine's tokens, and
    no KV crosses the wire; asked again, its own prefix cache serves the prompt's 70 full
    blocks, and the usage counts them. The first message's TTFT parts time the local queue,
    chunks and emit within the call, with no transfer; the worker's steps count three chunks
    of compute the first time, one short one the second, then a step per later token."""
    prefill, decode = cluster.workers
    backend = cluster.kv_backend
    received = lambda: decode.metric(  # noqa: E731
        "pdserve_kv_transfer_bytes_total", backend=backend, direction="received"
    )
    before = received()
    steps = lambda: decode.metric("pdserve_engine_step_seconds_count")  # noqa: E731
    recipe = " ".join(f"Step {i}: stir in {i * 2} grams of flour." for i in range(80))
    prompt = llm.tokenizer.encode(recipe)  # seen by no earlier test; three chunks of 512
    assert len(prompt) // 16 == 70
    for cached, num_chunks in ((0, 3), (70 * 16, 1)):
        steps_before = steps()
        started = time.monotonic()
        messages = generate(
            decode.address, prompt, prefill.address, prefill_here=True, max_tokens=8,
            temperature=0.0, ignore_eos=True,
        )  # fmt: skip
        elapsed_s = time.monotonic() - started
        assert token_ids(messages) == reference(prompt, 8)
        assert messages[-1].finish_reason == "length"
        usage = messages[-1].usage
        assert (usage.prompt_tokens, usage.cached_prompt_tokens) == (len(prompt), cached)
        ttft = next(m for m in messages if m.token_ids).ttft
        assert ttft.kv_transfer_s == 0
        assert min(ttft.prefill_queue_s, ttft.prefill_compute_s, ttft.first_token_emit_s) > 0
        assert ttft.prefill_queue_s + ttft.prefill_compute_s + ttft.first_token_emit_s < elapsed_s
        assert steps() - steps_before == num_chunks + 7  # the last chunk samples the first token
    assert received() == before
    cluster.assert_idle(prefill, decode)
