"""An int8 KV cache end to end through real processes: the prefill worker ships the int8 rows and
their scales (33/128 of fp32's bytes), the decode output equals the single-process int8-KV
engine's, and a prefill worker whose cache dtype differs is refused (the decode worker retries on
one that matches)."""

from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from tests.cluster import Cluster
from tests.workers.calls import LONG_PROMPT, generate, token_ids

INT8 = ("--kv-cache-dtype", "int8")
INT8_BYTES_PER_BLOCK = 190_080  # 30 layers * (K, V) * 16 tokens * 3 heads * (64 + 2 scale bytes)
FP32_BYTES_PER_BLOCK = 737_280


@pytest.fixture(scope="module")
def int8_cluster():
    """An int8 prefill and decode worker, and a default (fp32 KV) prefill worker."""
    cluster = Cluster(kv_backend="tcp")
    try:
        for role, args in (("prefill", INT8), ("decode", INT8), ("prefill", ())):
            cluster.start(role, *args, wait=False)
        cluster.wait_all_registered()
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture(scope="module")
def int8_kv_llm():
    return LLM(
        num_threads=1, device="cpu", kv_cache_dtype="int8", quantization="none"
    )  # as the workers


def test_int8_kv_ships_its_bytes_and_decodes_as_one_process(int8_cluster, int8_kv_llm):
    prefill, decode, _ = int8_cluster.workers
    sent = lambda: prefill.metric(  # noqa: E731
        "pdserve_kv_transfer_bytes_total", backend="tcp", direction="sent"
    )
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    tokenizer = int8_kv_llm.tokenizer
    for prompt in (tokenizer.encode("The capital of France is"), tokenizer.encode(LONG_PROMPT)):
        before = sent()
        messages = generate(
            decode.address, prompt, prefill.address, max_tokens=8, temperature=0.0,
            ignore_eos=True,
        )  # fmt: skip
        assert token_ids(messages) == int8_kv_llm.generate([prompt], params)[0].token_ids
        num_blocks = -(-len(prompt) // 16)
        assert sent() - before == num_blocks * INT8_BYTES_PER_BLOCK
        # What fp32 would have moved for the same prompt: 128/33 times as much (bf16: 64/33).
        assert (sent() - before) * 128 == num_blocks * FP32_BYTES_PER_BLOCK * 33
    load = int8_cluster.load(decode)
    assert load.free_blocks == load.total_blocks


def test_a_prefill_worker_with_another_cache_dtype_is_refused(int8_cluster, int8_kv_llm):
    """The fp32 prefill worker's header names float32; the int8 decode worker's inbox refuses it
    before a byte lands (FAILED_PRECONDITION from the prefill worker), and the decode worker
    retries on the other prefill worker, whose cache matches."""
    prefill, decode, fp32_prefill = int8_cluster.workers
    refused = lambda: fp32_prefill.metric(  # noqa: E731
        "pdserve_prefill_requests_total", outcome="kv_mismatch"
    )
    prompt = int8_kv_llm.tokenizer.encode("Mismatched caches must not mix:")
    before = refused()
    messages = generate(decode.address, prompt, fp32_prefill.address, max_tokens=4,
                        temperature=0.0, ignore_eos=True)  # fmt: skip
    assert refused() - before == 1
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    assert token_ids(messages) == int8_kv_llm.generate([prompt], params)[0].token_ids
    load = int8_cluster.load(decode)
    assert load.free_blocks == load.total_blocks
