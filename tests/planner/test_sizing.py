"""The formulas and the limits, with counts worked out by hand from the conftest profile."""

from __future__ import annotations

import pytest

from planner.settings import PlannerSettings
from planner.sizing import (
    after_cooldown,
    backlog_tokens,
    decode_replicas,
    prefill_replicas,
    prefill_workers,
    within_bounds,
    within_budget,
)


@pytest.mark.parametrize(
    ("rate", "correction", "utilization", "replicas"),
    [
        (10.0, 1.0, 1.0, 1),  # 4,000 prompt tokens/s on 4,000/s workers
        (10.0, 1.0, 0.5, 2),  # each worker kept half busy
        (10.0, 3.0, 0.5, 2),  # slower than profiled (queueing): not counted twice
        (10.0, 0.5, 0.5, 1),  # faster than profiled (cache hits): fewer
        (10.5, 1.0, 1.0, 2),
        (0.0, 1.0, 1.0, 0),
    ],
)
def test_prefill_replicas(profile, rate, correction, utilization, replicas):
    assert prefill_replicas(rate, 400, correction, utilization, profile) == replicas


def test_prefill_replicas_ceil_ignores_float_dust(profile):
    # 3 x 0.1 x (4000 / 3) / 400 is 1.0000000000000002 in floats, exactly 1 in reals
    assert prefill_replicas(3 * 0.1, 4000 / 3, 1.0, 1.0, profile) == 1


@pytest.mark.parametrize(
    ("arriving", "drain", "replicas"),
    [
        (4000.0, 0.0, 2),  # 4,000 tokens/s on 4,000/s workers kept half busy
        (4000.0, 2000.0, 3),  # + half a worker busy throughout on the backlog: 2.5
        (0.0, 4000.0, 1),  # a backlog alone: no headroom needed
        (0.0, 4001.0, 2),
        (0.0, 0.0, 0),
    ],
)
def test_prefill_workers_add_the_backlog_without_headroom(profile, arriving, drain, replicas):
    assert prefill_workers(arriving, drain, 400, 0.5, profile) == replicas


def test_prefill_replicas_with_a_backlog_to_drain(profile):
    # 4,000 prompt tokens/s at half busy: 2; 4,000/s of backlog: one more worker
    assert prefill_replicas(10.0, 400, 1.0, 0.5, profile, drain_tokens_per_s=4000.0) == 3
    # a correction over 1 still counts neither term twice
    assert prefill_replicas(10.0, 400, 3.0, 0.5, profile, drain_tokens_per_s=4000.0) == 3
    # no traffic forecast (rate or length 0), a backlog all the same: at 400 tokens' speed
    assert prefill_replicas(0.0, 0.0, 1.0, 0.5, profile, drain_tokens_per_s=4000.0) == 1


@pytest.mark.parametrize(
    ("queued", "workers", "prompt_tokens", "backlog"),
    [
        (5000.0, 2, 400, 1000.0),  # 2 workers x 4,000/s x 0.5 s = 4,000 within the target
        (4000.0, 2, 400, 0.0),
        (3000.0, 2, 1000, 0.0),  # 1,000-token prompts: 4,000/s too
        (5000.0, 0, 400, 5000.0),  # no worker: all of it
        (5000.0, 2, 0, 1000.0),  # no length known: at the shortest profiled (400)
    ],
)
def test_backlog_is_what_the_pool_cannot_prefill_within_the_target(
    profile, queued, workers, prompt_tokens, backlog
):
    assert backlog_tokens(queued, workers, prompt_tokens, 0.5, profile) == backlog


@pytest.mark.parametrize(
    ("rate", "correction", "replicas"),
    [
        (8.0, 1.0, 1),  # 800 output tokens/s; context 412 -> row 512: 800/s at 40 ms
        (8.5, 1.0, 2),
        (8.0, 1.6, 2),  # target 50 / 1.6 = 31 ms: batch 8, 400/s per worker
        (8.0, 10.0, 8),  # 5 ms: nothing meets it, batch 1's 100/s
    ],
)
def test_decode_replicas(profile, rate, correction, replicas):
    # prompt 312 + output 100 / 2 = context 362
    assert decode_replicas(rate, 312, 100, correction, 0.05, profile) == replicas


def test_decode_replicas_at_a_longer_context(profile):
    # context 1,000 + 200 / 2 = 1,100 -> the 2048 row: 200 tok/s (batch 8 at 40 ms)
    assert decode_replicas(2.0, 1000, 200, 1.0, 0.05, profile) == 2


def test_bounds_clamp_each_pool():
    s = PlannerSettings(min_prefill=1, max_prefill=3, min_decode=2, max_decode=4)
    assert within_bounds({"prefill": 0, "decode": 9}, s) == {"prefill": 1, "decode": 4}


@pytest.mark.parametrize(
    ("wanted", "gpus", "budget", "out"),
    [
        ((3, 2), (2, 2), 16, (3, 2)),  # within the budget: unchanged
        ((6, 4), (2, 2), 16, (5, 3)),  # x0.8: 4.8 -> 4, 3.2 -> 3; the spare 2 GPUs to prefill
        ((3, 3), (2, 2), 10, (3, 2)),  # x0.83: 2, 2; spare 2 GPUs back to prefill
        ((5, 5), (1, 2), 12, (4, 4)),  # x0.8: 4 + 2 x 4 = 12
        ((9, 1), (2, 2), 8, (3, 1)),  # x0.4: decode 0.4 -> 0 is kept at its minimum, 1
    ],
)
def test_budget_shrinks_both_pools_in_proportion(wanted, gpus, budget, out):
    s = PlannerSettings(gpus_per_prefill=gpus[0], gpus_per_decode=gpus[1], gpu_budget=budget,
                        max_prefill=10, max_decode=10)  # fmt: skip
    result = within_budget({"prefill": wanted[0], "decode": wanted[1]}, s)
    assert (result["prefill"], result["decode"]) == out
    assert result["prefill"] * gpus[0] + result["decode"] * gpus[1] <= budget


def test_cooldown_holds_a_recently_changed_pool():
    s = PlannerSettings(scale_up_cooldown_s=30, scale_down_cooldown_s=300)
    actual = {"prefill": 3, "decode": 3}
    wanted = {"prefill": 2, "decode": 4}
    assert after_cooldown(wanted, actual, {"prefill": 299, "decode": 29}, s) == actual
    assert after_cooldown(wanted, actual, {"prefill": 300, "decode": 30}, s) == wanted
