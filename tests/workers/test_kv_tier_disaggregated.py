"""A disaggregated request whose prompt prefix the decode worker's pool evicted into its host KV
tier, over real processes: the decode worker loads it back into the request's blocks (the
prefill worker writes only the blocks past them), and the tokens are those of the first, fully
computed request."""

from __future__ import annotations

import random
from collections.abc import Iterator

import pytest

from tests.cluster import Cluster
from tests.workers.calls import generate, token_ids

BLOCK = 16
NUM_BLOCKS = 32  # 512 tokens: a 496-token prompt and its reply take every block
TIER_GIB = 64 * BLOCK * 46_080 / 2**30  # 64 fp32 blocks of SmolLM2-135M
HOST_HITS = "pdserve_kv_tier_lookups_total"


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    started = Cluster(kv_backend="tcp")
    small = ("--num-blocks", str(NUM_BLOCKS))
    try:
        started.start("prefill", *small, wait=False)
        started.start("decode", *small, "--kv-offload-gb", str(TIER_GIB), wait=False)
        started.wait_all_registered()
        yield started
    finally:
        started.stop()


def tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, 40000) for _ in range(n)]


def test_a_prefix_in_the_decode_workers_tier_is_served_from_it(cluster):
    prefill, decode = cluster.workers
    greedy = dict(max_tokens=8, temperature=0.0, ignore_eos=True)
    prompt = tokens(1, 200)  # 12 full blocks before the last token

    def serve(ids: list[int]) -> list[int]:
        return token_ids(generate(decode.address, ids, prefill.address, **greedy))

    first = serve(prompt)
    serve(tokens(2, 496))  # takes both pools: the prompt's blocks leave them
    hits_before = decode.metric(HOST_HITS, tier="host", result="hit")
    again = serve(prompt)

    assert again == first
    assert decode.metric(HOST_HITS, tier="host", result="hit") - hits_before == 12
