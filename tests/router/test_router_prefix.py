"""KV-aware routing over real processes (two prefill and two decode workers, a router in this
process): a conversation's next turn goes where its prefix is cached when loads are equal,
load wins over a heavily loaded holder, and evicted blocks leave the router's index."""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Iterator

import grpc
import httpx
import pytest
from router_harness import MODEL, InProcessRouter

from engine.prefix_hash import prompt_block_hashes
from pdserve.v1 import generation_pb2 as pb
from pdserve.worker.v1 import worker_pb2 as wpb
from pdserve.worker.v1 import worker_pb2_grpc
from router.prefix_index import Choice
from router.settings import RouterSettings
from tests.cluster import Cluster, WorkerProcess
from tests.waiting import wait_until

BLOCK = 16
PREFILL_BLOCKS = 128  # a 2047-token prompt takes every block: everything cached is evicted


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    started = Cluster(kv_backend="tcp")
    try:
        for role in ("prefill", "prefill", "decode", "decode"):
            args = ("--num-blocks", str(PREFILL_BLOCKS)) if role == "prefill" else ()
            started.start(role, *args, wait=False)
        started.wait_all_registered()
        yield started
    finally:
        started.stop()


@pytest.fixture(scope="module")
def router(cluster: Cluster) -> Iterator[InProcessRouter]:
    started = InProcessRouter(RouterSettings(redis_url=cluster.redis.url, http_port=0,
                                             grpc_port=0))  # fmt: skip
    yield started
    started.stop()


def workers(cluster: Cluster, role: str) -> list[WorkerProcess]:
    return [w for w in cluster.workers if w.role == role]


def tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, 40000) for _ in range(n)]


def wait_idle(router: InProcessRouter) -> None:
    """Until the router sees every worker idle, in heartbeats sent after the requests so far
    ended (an older one may show a request that has finished): equal loads."""
    since = time.time()

    def idle() -> bool:
        pool = router.server.pool
        prefill, decode = pool.views("prefill"), pool.views("decode")
        fresh = all(v.info.updated_at > since for v in prefill + decode)
        return (
            fresh
            and all(v.queued_tokens == 0 for v in prefill)
            and (all(v.running_requests == 0 for v in decode))
        )

    wait_until(idle, timeout_s=60, interval_s=0.05, message="every worker is idle")


def wait_indexed(router: InProcessRouter, worker: WorkerProcess, prompt: list[int]) -> None:
    hashes = set(prompt_block_hashes(prompt + [0], BLOCK))  # every full block of the prompt
    index = router.server.prefixes
    wait_until(
        lambda: hashes <= index.cached_hashes(worker.worker_id),
        timeout_s=60,
        interval_s=0.05,
        message=f"the index shows {worker.worker_id} holding the prompt",
    )


def direct(decode: WorkerProcess, prefill: WorkerProcess, prompt: list[int], max_tokens: int):
    """A greedy request straight to chosen workers (no router); returns its output ids."""
    stub = worker_pb2_grpc.DecodeStub(grpc.insecure_channel(decode.address))
    request = wpb.DecodeRequest(
        prompt_token_ids=prompt, prefill_address=prefill.address,
        params=pb.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
    )  # fmt: skip
    return [t for m in stub.Generate(request, timeout=300) for t in m.token_ids]


def complete(router: InProcessRouter, prompt: list[int], max_tokens: int) -> dict:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True}  # fmt: skip
    response = httpx.post(f"{router.http_url}/v1/completions", json=body, timeout=300)
    assert response.status_code == 200, response.text
    return response.json()


def last_choice(router: InProcessRouter) -> Choice:
    return router.server.prefixes.recent[-1]


def test_the_next_turn_goes_to_the_workers_holding_its_prefix(cluster, router):
    prefill_0, prefill_1 = workers(cluster, "prefill")
    decode_0, decode_1 = workers(cluster, "decode")
    # Turn 1 on the workers a load-only router would not pick (ties go to the lowest id).
    turn_1 = tokens(1, 330)
    reply = direct(decode_1, prefill_1, turn_1, max_tokens=8)
    wait_indexed(router, prefill_1, turn_1)
    wait_indexed(router, decode_1, turn_1 + reply[:-1])  # the last token has no KV yet
    wait_idle(router)
    turn_2 = turn_1 + reply + tokens(2, 40)
    usage = complete(router, turn_2, max_tokens=4)["usage"]
    assert last_choice(router) == Choice(
        last_choice(router).request_id, prefill_1.worker_id, 320,  # 20 full blocks of turn 1
        decode_1.worker_id, 336,  # 21 blocks: turn 1 and 7 decoded tokens
    )  # fmt: skip
    # What the prefill worker did not compute: its 320 tokens, and the block of turn 1's reply
    # that only decode_1 holds, read from it (peer fetch).
    assert usage["prompt_tokens_details"] == {"cached_tokens": 336}
    # A conversation cached nowhere goes by load alone: the lowest id at equal load.
    wait_idle(router)
    complete(router, tokens(3, 100), max_tokens=2)
    choice = last_choice(router)
    assert (choice.prefill_worker, choice.prefill_overlap_tokens) == (prefill_0.worker_id, 0)
    assert (choice.decode_worker, choice.decode_overlap_tokens) == (decode_0.worker_id, 0)


def test_load_wins_over_a_heavily_loaded_holder(cluster, router):
    prefill_0, prefill_1 = workers(cluster, "prefill")
    wait_idle(router)
    turn_1 = tokens(4, 330)
    reply = complete(router, turn_1, max_tokens=4)["choices"][0]
    holder = last_choice(router).prefill_worker
    assert holder == prefill_0.worker_id  # equal load, nothing cached: the lowest id
    wait_indexed(router, prefill_0, turn_1)
    wait_idle(router)
    # A long prompt cached nowhere also goes to prefill_0; while it is prefilled there (the
    # router's ledger holds its tokens until its first token), the next turn comes.
    long = threading.Thread(target=complete, args=(router, tokens(5, 1500), 1))
    long.start()
    ledger = router.server.pool.ledgers["prefill"]
    wait_until(
        lambda: ledger.share(prefill_0.worker_id).amount == 1500,
        timeout_s=60,
        interval_s=0.05,
        message="the long prompt is on",
    )
    turn_2 = turn_1 + tokens(6, 4) + tokens(7, 40)
    complete(router, turn_2, max_tokens=2)
    choice = last_choice(router)
    long.join()
    assert reply["finish_reason"] == "length"
    assert (choice.prefill_worker, choice.prefill_overlap_tokens) == (prefill_1.worker_id, 0)


def test_evicted_blocks_leave_the_index(cluster, router):
    prefill_0, _ = workers(cluster, "prefill")
    decode_0, _ = workers(cluster, "decode")
    wait_idle(router)
    index = router.server.prefixes
    # Something cached on prefill_0 first, whichever tests ran before.
    earlier = tokens(9, 3 * BLOCK)
    direct(decode_0, prefill_0, earlier, max_tokens=1)
    first_block = prompt_block_hashes(earlier, BLOCK)[0]
    wait_until(
        lambda: first_block in index.cached_hashes(prefill_0.worker_id),
        timeout_s=60, interval_s=0.05, message="the index holds the earlier prompt's first block",
    )  # fmt: skip
    # A prompt needing every block of prefill_0 evicts all it had cached.
    flood = tokens(8, PREFILL_BLOCKS * BLOCK - 1)
    direct(decode_0, prefill_0, flood, max_tokens=1)
    expected = set(prompt_block_hashes(flood + [0], BLOCK))
    assert len(expected) == PREFILL_BLOCKS - 1  # its last, partial block is never cached
    wait_until(
        lambda: index.cached_hashes(prefill_0.worker_id) == expected,
        timeout_s=60,
        interval_s=0.05,
        message="the index holds exactly the new prompt's blocks",
    )
