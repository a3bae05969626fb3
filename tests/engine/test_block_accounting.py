"""Every KV block is free again after a mixed workload: finished, stopped by a stop string,
preempted (and recomputed) and aborted requests."""

from __future__ import annotations

from engine import LLM, SamplingParams

GREEDY = dict(temperature=0.0, ignore_eos=True)
PROMPTS = [f"Story {i}: once upon a time in a kingdom by the sea, there lived a" for i in range(4)]


def run_to_completion(engine, requests):
    while any(not r.is_finished for r in requests):
        engine.step()


def test_mixed_workload_leaves_every_block_free():
    # 24 blocks = 384 token slots: four requests growing to ~100 tokens each must preempt.
    llm = LLM(
        num_threads=2, device="cpu", num_blocks=24, chunk_size=128, quantization="none"
    )  # fp32 tokens
    engine = llm.engine
    growing = [
        engine.add_request(f"grow-{i}", p, SamplingParams(max_tokens=80, **GREEDY))
        for i, p in enumerate(PROMPTS)
    ]
    stopped = engine.add_request(
        "stop", "1, 2, 3, 4,", SamplingParams(max_tokens=12, stop=[" 7"], **GREEDY)
    )
    aborted = engine.add_request("abort", PROMPTS[0], SamplingParams(max_tokens=50, **GREEDY))
    for _ in range(3):
        engine.step()
    engine.abort_request("abort")
    run_to_completion(engine, [*growing, stopped])

    assert aborted.finish_reason == "abort"
    assert stopped.finish_reason == "stop"
    assert stopped.text == " 5, 6,"
    assert stopped.output_token_ids == [216, 37, 28, 216, 38, 28, 216, 39]  # "7" completed " 7"
    assert [r.finish_reason for r in growing] == ["length"] * 4
    assert sum(r.num_preemptions for r in growing) > 0
    assert engine.pool.num_free_blocks == engine.pool.num_blocks == 24
    engine.kv.check_integrity()

    # A preempted-and-recomputed request produced exactly what it produces alone.
    preempted = next(r for r in growing if r.num_preemptions)
    alone = llm.generate([preempted.prompt_token_ids], SamplingParams(max_tokens=80, **GREEDY))
    assert alone[0].token_ids == preempted.output_token_ids
    assert engine.pool.num_free_blocks == 24
