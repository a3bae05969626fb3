"""Cross-worker prefix reuse over real processes: a prefill worker lacking a prefix that the
decode worker holds reads it instead of computing it, and the tokens equal a full prefill's;
a read that fails midway is computed after all, with the same tokens and no block left held."""

from __future__ import annotations

import random
import sys
from collections.abc import Iterator

import grpc
import pytest

from engine import SamplingParams
from pdserve.v1 import generation_pb2 as pb
from pdserve.worker.v1 import worker_pb2 as wpb
from pdserve.worker.v1 import worker_pb2_grpc
from tests.cluster import Cluster, WorkerProcess
from tests.workers.faulty_worker import UNREADABLE

FAULTY = (sys.executable, "-m", "tests.workers.faulty_worker")
BLOCK = 16
PROMPT_TOKENS = "pdserve_prefill_prompt_tokens_total"


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    started = Cluster(kv_backend="tcp")
    try:
        started.start("prefill", wait=False)
        started.start("prefill", wait=False)
        started.start("decode", wait=False, program=FAULTY)  # UNREADABLE ids: reads fail
        started.wait_all_registered()
        yield started
    finally:
        started.stop()


def tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, 40000) for _ in range(n)]


def generate(
    decode: WorkerProcess, prefill: WorkerProcess, prompt: list[int], request_id: str,
    max_tokens: int = 6,
):  # fmt: skip
    """A greedy request straight to chosen workers: (output ids, the final usage)."""
    stub = worker_pb2_grpc.DecodeStub(grpc.insecure_channel(decode.address))
    request = wpb.DecodeRequest(
        request_id=request_id, prompt_token_ids=prompt, prefill_address=prefill.address,
        params=pb.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
    )  # fmt: skip
    messages = list(stub.Generate(request, timeout=300))
    return [t for m in messages for t in m.token_ids], messages[-1].usage


def sources(prefill: WorkerProcess) -> dict[str, float]:
    return {s: prefill.metric(PROMPT_TOKENS, source=s)
            for s in ("computed", "prefix_cache", "peer_fetch")}  # fmt: skip


def pool_lookups(prefill: WorkerProcess) -> dict[str, float]:
    return {r: prefill.metric("pdserve_kv_tier_lookups_total", tier="pool", result=r)
            for r in ("hit", "miss")}  # fmt: skip


def delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {k: after[k] - before[k] for k in after}


def second_turn(cluster: Cluster, seed: int) -> list[int]:
    """Turn 1 prefilled on prefill-0 and decoded on the decode worker, which then holds the
    prompt and its reply; turn 2 appends them and a new question."""
    prefill_0, _, decode = cluster.workers
    turn_1 = tokens(seed, 330)
    reply, _ = generate(decode, prefill_0, turn_1, f"turn-1-{seed}", max_tokens=8)
    return turn_1 + reply + tokens(seed + 1, 40)


@pytest.fixture(scope="module")
def reference(llm):
    def run(prompt: list[int]) -> list[int]:
        params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
        return llm.generate([prompt], params)[0].token_ids

    return run


def assert_idle(cluster: Cluster) -> None:
    for worker in cluster.workers:
        load = cluster.load(worker)
        assert load.free_blocks == load.total_blocks, worker.worker_id


def test_a_prefix_read_from_the_decode_worker_equals_a_full_prefill(cluster, reference):
    _, prefill_1, decode = cluster.workers
    turn_2 = second_turn(cluster, seed=1)
    assert len(turn_2) == 378
    before, lookups_before = sources(prefill_1), pool_lookups(prefill_1)

    output, usage = generate(decode, prefill_1, turn_2, "turn-2")

    assert output == reference(turn_2)
    # The decode worker holds 21 full blocks (turn 1's 330 tokens and the first 6 of its
    # reply; its last 2 tokens' block is not full): prefill-1, which has none, reads them.
    assert delta(sources(prefill_1), before) == {
        "computed": 378 - 336, "prefix_cache": 0, "peer_fetch": 336
    }  # fmt: skip
    assert usage.cached_prompt_tokens == 336
    # One lookup, the fetch plan's: its first block missed. The read blocks the request's
    # prefix match then finds are not counted again as pool hits.
    assert delta(pool_lookups(prefill_1), lookups_before) == {"hit": 0, "miss": 1}
    assert_idle(cluster)


def test_a_read_that_fails_midway_is_computed_after_all(cluster, reference):
    _, prefill_1, decode = cluster.workers
    turn_2 = second_turn(cluster, seed=3)
    before = sources(prefill_1)
    fetches_failed = prefill_1.metric("pdserve_prefill_peer_fetches_total", outcome="failed")

    # The decode worker sends the blocks, then says it let go of them while they were read:
    # prefill-1 must not trust (or cache) them.
    output, usage = generate(decode, prefill_1, turn_2, f"{UNREADABLE}-turn-2")

    assert output == reference(turn_2)
    assert delta(sources(prefill_1), before) == {
        "computed": 378, "prefix_cache": 0, "peer_fetch": 0
    }  # fmt: skip
    assert usage.cached_prompt_tokens == 0
    failed = prefill_1.metric("pdserve_prefill_peer_fetches_total", outcome="failed")
    assert failed == fetches_failed + 1
    assert_idle(cluster)
