"""Admission, pure, with aggregated workers: which pool serves a request, aggregated-only
clusters, and shedding by the predicted time to first token (no processes)."""

from __future__ import annotations

import asyncio

import pytest
from router_harness import Clock, ticket, worker

from router.admission import Admission
from router.errors import OverloadedError, UnavailableError
from router.routing import build_policies
from router.settings import AdmissionSettings, RoutingSettings
from router.workers import WorkerPool


def admission(*infos, clock=None, **settings) -> Admission:
    admission_settings = AdmissionSettings(**settings)
    pool = WorkerPool(500.0)
    for role in ("prefill", "decode", "aggregated"):
        pool.update(role, [i for i in infos if i.role == role])
    policies = build_policies(RoutingSettings("watermark"), admission_settings)
    return Admission(admission_settings, pool, policies, clock or Clock())


SPLIT = (worker("prefill", "p", tokens_per_s=1000), worker("decode", "d"))
AGGREGATED = worker("aggregated", "a", tokens_per_s=1000)


def test_aggregated_only_cluster_serves_whole_requests_on_one_worker():
    async def scenario() -> None:
        adm = admission(AGGREGATED)
        lease = await adm.admit(ticket("r", 320, max_tokens=16))
        assert lease.prefill is lease.decode and lease.decode.worker_id == "a"
        (view,) = adm.pool.views("aggregated")
        assert (view.queued_tokens, view.free_blocks) == (320, 1024 - 21)
        lease.end_prefill()  # the first token: its prompt no longer queues, its KV stays
        (view,) = adm.pool.views("aggregated")
        assert (view.queued_tokens, view.free_blocks) == (0, 1024 - 21)
        lease.end()
        (view,) = adm.pool.views("aggregated")
        assert (view.queued_tokens, view.free_blocks) == (0, 1024)

    asyncio.run(scenario())


@pytest.mark.parametrize(
    "num_prompt, expected",
    [
        pytest.param(100, ("a", "a"), id="short-goes-whole-to-aggregated"),
        pytest.param(600, ("p", "d"), id="medium-goes-split"),
        pytest.param(3000, ("p", "d"), id="long-goes-split"),
    ],
)
def test_mixed_cluster_routes_short_prompts_whole_and_longer_ones_split(num_prompt, expected):
    async def scenario() -> tuple[str, str]:
        lease = await admission(*SPLIT, AGGREGATED).admit(ticket("r", num_prompt))
        return lease.prefill.worker_id, lease.decode.worker_id

    assert asyncio.run(scenario()) == expected


def test_no_pool_that_can_serve_is_unavailable():
    async def scenario() -> None:
        with pytest.raises(UnavailableError) as missing:
            await admission(worker("decode", "d")).admit(ticket("r", 100))
        assert missing.value.message == (
            "no prefill worker (and no aggregated worker) is registered; retry when one is up"
        )
        full = admission(worker("aggregated", "a", free_blocks=40))
        with pytest.raises(OverloadedError) as no_kv:
            await full.admit(ticket("r", 100))
        assert no_kv.value.reason == "kv_headroom"

    asyncio.run(scenario())


def test_a_bounded_closed_loop_under_the_ttft_slo_gets_no_429():
    """32 clients, 256-token prompts, one prefill worker at 500 tokens/s and a budget of one
    prompt: the last one in is predicted to wait for 31 prompts and its own, 16.4 s; under a
    30 s objective all queue, none is rejected."""

    async def scenario() -> float:
        adm = admission(worker("prefill", "p", tokens_per_s=500), worker("decode", "d"),
                        prefill_token_budget=256)  # fmt: skip
        leases = [await adm.admit(ticket("c0", 256))]
        waiting = [asyncio.ensure_future(adm.admit(ticket(f"c{i}", 256))) for i in range(1, 32)]
        await asyncio.sleep(0)
        assert len(adm.queue) == 31 and not any(f.done() for f in waiting)
        probe_s = adm.predicted_ttft_s(ticket("probe", 256))
        for future in waiting:  # each finished request lets the next one go, in order
            leases[-1].end()
            await asyncio.sleep(0)
            leases.append(future.result())  # raises if it was rejected
        leases[-1].end()
        return probe_s

    # A probe behind all 32: 32 * 256 in front, then its own 256, at 500 tokens/s.
    assert asyncio.run(scenario()) == pytest.approx(33 * 256 / 500)


def test_predicted_ttft_over_the_slo_is_rejected_with_an_honest_retry_after():
    async def scenario() -> None:
        adm = admission(*SPLIT, prefill_token_budget=1000, ttft_slo_s=3.0)
        await adm.admit(ticket("busy", 2500))  # 2500 queued tokens at 1000 tokens/s
        with pytest.raises(OverloadedError) as rejected:
            await adm.admit(ticket("excess", 600))
        assert rejected.value.reason == "queue_wait"
        # 2500 in front + its own 600 at 1000 tokens/s = 3.1 s predicted: 0.1 s over, so the
        # floor of 1 s; a later, bigger one is told what it is over by.
        assert rejected.value.retry_after_s == 1.0
        with pytest.raises(OverloadedError) as bigger:
            await adm.admit(ticket("bigger", 2900))
        assert bigger.value.retry_after_s == pytest.approx(2.4)
        assert str(bigger.value) == (
            "predicted time to first token 5.4 s is over the 3.0 s SLO; retry in 2 s"
        )
        assert len(adm.queue) == 0
        fits = asyncio.ensure_future(adm.admit(ticket("fits", 400)))
        await asyncio.sleep(0)
        assert len(adm.queue) == 1  # 2.9 s predicted: it waits
        fits.cancel()

    asyncio.run(scenario())


def test_by_default_nothing_is_shed_by_prediction_only_past_the_queue_limit():
    """No TTFT objective by default: 40 s of prefill in front of a request queues it; the
    queue limit is what rejects."""

    async def scenario() -> None:
        slow = worker("prefill", "p", tokens_per_s=100)
        adm = admission(slow, worker("decode", "d"), prefill_token_budget=1000,
                        max_queued_requests=2)  # fmt: skip
        await adm.admit(ticket("busy", 4000))  # 40 s at 100 tokens/s
        waiting = [asyncio.ensure_future(adm.admit(ticket(f"w{i}", 600))) for i in range(3)]
        await asyncio.sleep(0)
        assert len(adm.queue) == 2 and not any(f.done() for f in waiting[:2])
        with pytest.raises(OverloadedError) as full:
            waiting[2].result()
        # Its wait: 4000 + 1200 ahead + its own 600 beyond the 1000-token budget, at 100/s.
        assert (full.value.reason, str(full.value)) == (
            "queue_full",
            "2 requests queued; retry in 48 s",
        )
        for future in waiting[:2]:
            future.cancel()

    asyncio.run(scenario())


def test_the_prediction_learns_what_requests_saw_and_sheds_by_it():
    """A first token that took twice the modelled time (and too few tokens for the drain meter
    to sample) doubles the next predictions: a request modelled at 8 s is shed under a 10 s
    objective, 16 s predicted."""

    async def scenario() -> tuple[float, float, OverloadedError]:
        clock = Clock()
        slow = worker("prefill", "p", tokens_per_s=100)
        adm = admission(slow, worker("decode", "d"), clock=clock, prefill_token_budget=500,
                        ttft_slo_s=10.0)  # fmt: skip
        probe = ticket("probe", 300)
        lease = await adm.admit(ticket("busy", 500))  # modelled 5 s to its first token
        before_s = adm.predicted_ttft_s(probe)  # 500 in front + its own 300 at 100 tokens/s
        clock.now = 10.0  # twice the modelled time
        lease.end_prefill()
        again = await adm.admit(ticket("again", 500))
        after_s = adm.predicted_ttft_s(probe)
        with pytest.raises(OverloadedError) as rejected:
            await adm.admit(probe)
        again.end()
        lease.end()
        return before_s, after_s, rejected.value

    before_s, after_s, rejected = asyncio.run(scenario())
    assert (before_s, after_s) == (pytest.approx(8.0), pytest.approx(16.0))
    assert rejected.reason == "queue_wait"
    assert (
        str(rejected) == "predicted time to first token 16.0 s is over the 10.0 s SLO; retry in 6 s"
    )


def test_the_tail_of_what_requests_saw_sheds_what_the_point_prediction_would_admit():
    """Nine first tokens at the modelled 5 s and one at 8 s: the correction is 1.06 (the
    smoothed sums), the ratios' 99th percentile 1.546, so a request predicted at 8.48 s under a
    10 s objective is shed by its tail, 12.37 s; before those samples it would have queued."""

    async def scenario() -> tuple[bool, OverloadedError]:
        clock = Clock()
        slow = worker("prefill", "p", tokens_per_s=100)
        adm = admission(slow, worker("decode", "d"), clock=clock, prefill_token_budget=500,
                        ttft_slo_s=10.0)  # fmt: skip
        busy = await adm.admit(ticket("busy", 500))
        probe = asyncio.ensure_future(adm.admit(ticket("probe", 300)))
        await asyncio.sleep(0)
        queued_before = len(adm.queue) == 1 and not probe.done()
        probe.cancel()
        busy.end()
        for i, observed_s in enumerate([5.0] * 9 + [8.0]):  # 500 tokens at 100/s: 5 s modelled
            lease = await adm.admit(ticket(f"r{i}", 500))
            clock.now += observed_s
            lease.end_prefill()
            lease.end()
        busy = await adm.admit(ticket("busy-again", 500))
        with pytest.raises(OverloadedError) as rejected:
            await adm.admit(ticket("probe-again", 300))
        busy.end()
        return queued_before, rejected.value

    queued_before, rejected = asyncio.run(scenario())
    assert queued_before
    assert rejected.reason == "queue_wait"
    assert str(rejected) == (
        "predicted time to first token 8.5 s (12.4 s at the 99th percentile) is over the "
        "10.0 s SLO; retry in 2 s"
    )
    assert rejected.retry_after_s == pytest.approx(8.48 * 1.546 / 1.06 - 10.0)


def test_the_estimates_use_the_drain_the_router_observed_when_it_is_slower():
    """The worker computes 1000 tokens/s, but its budget frees only at each first token."""

    async def scenario() -> list[float]:
        clock = Clock()
        adm = admission(*SPLIT, clock=clock)
        probe = ticket("probe", 400)
        speeds = [adm.predicted_ttft_s(probe)]  # nothing measured: the worker's own speed
        lease = await adm.admit(ticket("a", 600))
        clock.now = 1.2
        lease.end_prefill()  # 600 tokens drained in 1.2 s: 500 tokens/s
        lease.end()
        speeds.append(adm.predicted_ttft_s(probe))
        lease = await adm.admit(ticket("b", 600))
        clock.now = 1.3
        lease.end_prefill()  # 6000 tokens/s for once: smoothed, then capped by the worker's
        speeds.append(adm.predicted_ttft_s(probe))
        return speeds

    assert asyncio.run(scenario()) == [pytest.approx(0.4), pytest.approx(0.8), pytest.approx(0.4)]
