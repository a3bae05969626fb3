"""Routing policies, table-driven and pure: which worker each request goes to."""

from __future__ import annotations

from collections import Counter
from dataclasses import replace

import pytest
from router_harness import pool_of, ticket, with_load, worker

from router.routing import build_policies
from router.settings import AdmissionSettings, RoutingSettings
from router.workers import WorkerPool


def route_prefill(policy_name: str, infos, sizes: list[int], **routing) -> list[str]:
    """Routes requests one after another; each assignment stays queued on its worker (the
    ledger adds it to the worker's load), as when a burst arrives between heartbeats."""
    pool = pool_of(*infos)
    admission = AdmissionSettings(prefill_token_budget=1 << 30)
    policies = build_policies(RoutingSettings(policy_name, **routing), admission)
    chosen = []
    for i, size in enumerate(sizes):
        t = ticket(f"r{i}", size, prompt=[i, size])
        view = policies.prefill.choose(pool.views("prefill"), t)
        pool.assign("prefill", view.worker_id, size)
        chosen.append(view.worker_id)
    return chosen


WATERMARK_SPLITS = [
    # (a, b, speeds of workers a and b (0 = not measured yet), requests, tokens each, split)
    pytest.param(1.0, 0.0, (1000, 500), 30, 100, {"a": 20, "b": 10}, id="tokens-only"),
    pytest.param(0.6, 0.4, (1000, 500), 26, 1000, {"a": 16, "b": 10}, id="default-weights"),
    pytest.param(0.6, 0.4, (800, 800), 20, 256, {"a": 10, "b": 10}, id="equal-speeds"),
    pytest.param(1.0, 0.0, (500, 0), 20, 100, {"a": 10, "b": 10}, id="unmeasured=default"),
    pytest.param(0.0, 1.0, (1000, 100), 12, 100, {"a": 6, "b": 6}, id="requests-only"),
]


@pytest.mark.parametrize("a, b, speeds, num_requests, size, split", WATERMARK_SPLITS)
def test_watermark_gives_a_slower_worker_proportionally_less(
    a, b, speeds, num_requests, size, split
):
    infos = [worker("prefill", wid, tokens_per_s=s) for wid, s in zip("ab", speeds, strict=True)]
    chosen = route_prefill("watermark", infos, [size] * num_requests, watermark_a=a, watermark_b=b)
    assert Counter(chosen) == split


def test_watermark_prefers_the_worker_that_drains_sooner():
    # a: 3000 queued tokens at 1000/s = 3 s; b: 1000 tokens at 250/s = 4 s.
    infos = [
        worker("prefill", "a", tokens_per_s=1000, queued_tokens=3000),
        worker("prefill", "b", tokens_per_s=250, queued_tokens=1000),
    ]
    assert route_prefill("watermark", infos, [64], watermark_a=1.0, watermark_b=0.0) == ["a"]


def test_round_robin_alternates_whatever_the_load():
    infos = [worker("prefill", "a", queued_tokens=5000), worker("prefill", "b")]
    assert route_prefill("round_robin", infos, [100] * 4) == ["a", "b", "a", "b"]


def test_hash_keeps_a_prefix_on_one_worker_and_moves_only_the_removed_workers_prefixes():
    three = [worker("prefill", w) for w in "abc"]
    policies = build_policies(RoutingSettings("hash"), AdmissionSettings())
    tickets = [ticket(f"r{i}", 100, prompt=[i] * 100) for i in range(60)]
    before = {t.request_id: policies.prefill.choose(pool_of(*three).views("prefill"), t)
              for t in tickets}  # fmt: skip
    again = {t.request_id: policies.prefill.choose(pool_of(*three).views("prefill"), t)
             for t in tickets}  # fmt: skip
    assert {k: v.worker_id for k, v in before.items()} == {k: v.worker_id for k, v in again.items()}
    assert set(Counter(v.worker_id for v in before.values())) == {"a", "b", "c"}
    two = pool_of(*three[:2]).views("prefill")
    for t in tickets:
        after = policies.prefill.choose(two, t).worker_id
        if before[t.request_id].worker_id != "c":
            assert after == before[t.request_id].worker_id


DECODE_CHOICES = [
    # (free blocks of a and b, running requests of a and b, request KV blocks, chosen)
    pytest.param((900, 500), (0, 0), 10, "a", id="more-free-kv"),
    pytest.param((500, 500), (4, 1), 10, "b", id="fewer-running"),
    pytest.param((5, 500), (0, 8), 10, "b", id="a-cannot-hold-it"),
    pytest.param((5, 8), (0, 0), 10, None, id="nobody-can-hold-it"),
]


@pytest.mark.parametrize("free, running, num_blocks, expected", DECODE_CHOICES)
def test_decode_choice_by_kv_headroom_and_running_requests(free, running, num_blocks, expected):
    infos = [
        worker("decode", wid, free_blocks=f, running=r)
        for wid, f, r in zip("ab", free, running, strict=True)
    ]
    policies = build_policies(RoutingSettings("watermark"), AdmissionSettings())
    t = ticket("r", num_blocks * 16 - 16, max_tokens=16)
    view = policies.decode.choose(pool_of(*infos).views("decode"), t)
    assert (view.worker_id if view else None) == expected


BUDGET_CASES = [
    # (queued tokens on the worker, prompt tokens, budget, may it take the request?)
    pytest.param(0, 5000, 2048, True, id="idle-takes-an-over-budget-prompt"),
    pytest.param(1000, 1048, 2048, True, id="exactly-fills-the-budget"),
    pytest.param(1000, 1049, 2048, False, id="one-token-over"),
]


@pytest.mark.parametrize("queued, prompt, budget, fits", BUDGET_CASES)
def test_prefill_token_budget(queued, prompt, budget, fits):
    policies = build_policies(
        RoutingSettings("round_robin"), AdmissionSettings(prefill_token_budget=budget)
    )
    pool = pool_of(worker("prefill", "a", queued_tokens=queued))
    assert (policies.prefill.choose(pool.views("prefill"), ticket("r", prompt)) is not None) == fits


def test_a_worker_whose_context_is_too_short_is_never_chosen():
    infos = [worker("prefill", "a", max_model_len=2048), worker("prefill", "b")]
    policies = build_policies(RoutingSettings("round_robin"), AdmissionSettings())
    pool = pool_of(*infos)
    chosen = {policies.prefill.choose(pool.views("prefill"), ticket(f"r{i}", 2040)).worker_id
              for i in range(4)}  # fmt: skip
    assert chosen == {"b"}


def test_stale_heartbeat_load_is_corrected_by_the_routers_own_assignments():
    info = with_load(worker("prefill", "a", updated_at=100.0), queued_tokens=700)
    pool = pool_of(info)
    pool.ledgers["prefill"].clock = lambda: 50.0
    early = pool.assign("prefill", "a", 300)  # before the heartbeat: already in its 700
    pool.ledgers["prefill"].clock = lambda: 150.0
    late = pool.assign("prefill", "a", 200)  # after it: the heartbeat cannot know
    assert pool.views("prefill")[0].queued_tokens == 900
    pool.release("prefill", early)  # the 300 left the worker since the heartbeat
    assert pool.views("prefill")[0].queued_tokens == 600
    pool.release("prefill", late)
    assert pool.views("prefill")[0].queued_tokens == 400  # other routers' share
    assert pool.views("prefill")[0].queued_requests == 0


def test_the_pools_block_size_is_what_most_decode_side_workers_registered_with():
    def sized(role: str, worker_id: str, block_size: int):
        return replace(worker(role, worker_id), block_size=block_size)

    assert WorkerPool(500.0).block_size == 16  # none registered yet: the engine's default
    pool = pool_of(sized("prefill", "p", 64), sized("decode", "d0", 32))
    assert pool.block_size == 32  # the decode side's, not the prefill worker's
    pool.update("decode", [sized("decode", "d0", 32), sized("decode", "d1", 8)])
    assert pool.block_size == 8  # a tie: the smaller
    pool.update("aggregated", [sized("aggregated", "a0", 32)])
    assert pool.block_size == 32  # two of three
    pool.update("decode", [])
    pool.update("aggregated", [])
    assert pool.block_size == 16  # all gone: the default again


def test_a_decode_worker_at_its_request_limit_is_not_chosen_until_one_ends():
    infos = [replace(worker("decode", "a"), max_requests=2), worker("decode", "b")]
    policies = build_policies(RoutingSettings("watermark"), AdmissionSettings())
    pool = pool_of(*infos)
    pool.ledgers["decode"].clock = lambda: 10.0  # after the heartbeats (updated_at 0)
    held = [pool.assign("decode", "a", 1) for _ in range(2)]
    choices = {policies.decode.choose(pool.views("decode"), ticket(f"r{i}", 16)).worker_id
               for i in range(3)}  # fmt: skip
    assert choices == {"b"}  # a's two slots are taken; b states no limit
    pool.release("decode", held[0])
    assert policies.decode.choose(pool.views("decode")[:1], ticket("r", 16)).worker_id == "a"
    # Sequences count: two samples do not fit beside the one running; on an idle worker any
    # number does, as the engine takes them.
    assert policies.decode.choose(pool.views("decode")[:1], ticket("r", 16, num_seqs=2)) is None
    pool.release("decode", held[1])
    assert policies.decode.choose(pool.views("decode")[:1], ticket("r", 16, num_seqs=4))
    # pass_through, the plain-Service baseline, leaves the limit to the worker's refusal.
    passing = build_policies(RoutingSettings("watermark"), AdmissionSettings(mode="pass_through"))
    pool.assign("decode", "a", 1)
    assert passing.decode.choose(pool.views("decode")[:1], ticket("r", 16)).worker_id == "a"
