"""The simulator runs the real router and engine code: fixed seeds give exact results, and a
changed setting changes them the way that code dictates."""

from __future__ import annotations

import gc
from dataclasses import replace

import pytest

from engine import EngineConfig
from router.settings import AdmissionSettings
from sim.cluster import ClusterConfig, RouterMeter
from sim.scenario import Scenario, simulate
from sim.worker import WorkerSpec
from sim.workload import ClosedLoop, LengthMix, OpenLoop, Sequential, SimRequest
from tests.sim.conftest import LinearCost, pd_cluster

PROMPT_100 = LengthMix("fixed", prompt_tokens=100, output_tokens=(5, 5))


def test_an_idle_cluster_gives_the_ttft_worked_out_by_hand(cost: LinearCost):
    """client->router->decode->prefill (3 hops), one 100-token prefill step (10 + 100 ms),
    the last KV send (5 ms), the response (1 hop), then decode->router->client (2 hops); each
    of the 4 later tokens is one decode step (10 + 2 ms)."""
    result = simulate(Scenario("idle", pd_cluster(), PROMPT_100, ClosedLoop(1, 4)), cost)
    ttft = 6 * cost.hop_s + (0.010 + 0.100) + cost.transfer_s
    e2e = ttft + 4 * (0.010 + 0.002)
    assert [r.status for r in result.records] == [200] * 4
    for record in result.records:
        assert record.ttft_s == pytest.approx(ttft, abs=1e-9)
        assert record.e2e_s == pytest.approx(e2e, abs=1e-9)
        assert record.num_output_tokens == 5
    # Watermark placement: equal idle workers tie, and ties go to the lowest worker id.
    assert {r.prefill_worker for r in result.records} == {"p0"}


def test_an_idle_worker_starts_a_step_on_the_first_arrival(cost: LinearCost):
    """Two 48-token prompts reach an idle aggregated worker at the same instant: the first
    starts a step alone (10 + 48 ms), as the real engine thread wakes on the command that
    queued it, and the second waits for that step and takes the next; neither packs them.
    Each TTFT adds the hops client->router->worker and back."""
    engine = EngineConfig(step_overhead_tokens=0)  # packing: only the arrival order splits
    config = ClusterConfig((WorkerSpec("a0", "aggregated"),), engine, engine)
    load = OpenLoop(0.0, 10.0, bursts_s=(1.0,), burst_size=2)
    mix = LengthMix("fixed", prompt_tokens=48, output_tokens=(1, 1))
    result = simulate(Scenario("pair", config, mix, load), cost)
    step = 0.010 + 0.048
    assert [r.status for r in result.records] == [200, 200]
    assert [r.ttft_s for r in result.records] == pytest.approx(
        [step + 4 * cost.hop_s, 2 * step + 4 * cost.hop_s], abs=1e-9
    )


def test_a_closed_loop_client_pauses_before_each_request_it_sends(cost: LinearCost):
    """One client, two requests with pauses of 0.5 s and 0.25 s: the first is sent at 0.5 s,
    the second 0.25 s after the first's reply reached the client."""
    turns = [SimRequest(f"t{i}", list(range(1000, 1100)), 5, think_s=pause)
             for i, pause in enumerate((0.5, 0.25))]  # fmt: skip
    result = simulate(Scenario("pauses", pd_cluster(), PROMPT_100, ClosedLoop(1, 2)), cost,
                      source=Sequential([turns]))  # fmt: skip
    first, second = result.records
    assert first.sent_s == pytest.approx(0.5, abs=1e-9)
    assert first.e2e_s is not None
    assert second.sent_s == pytest.approx(0.5 + first.e2e_s + 0.25, abs=1e-9)


def test_a_burst_over_the_queue_limit_gets_exact_429s(cost: LinearCost):
    """Budget 300 tokens per prefill worker: 3 + 3 prompts dispatch at once, 10 wait in the
    router's queue, and Admission rejects the other 24 as queue_full."""
    admission = AdmissionSettings(prefill_token_budget=300, max_queued_requests=10,
                                  max_queue_wait_s=1000.0)  # fmt: skip
    load = OpenLoop(0.0, 10.0, bursts_s=(1.0,), burst_size=40)
    summary = simulate(Scenario("burst", pd_cluster(admission=admission), PROMPT_100, load),
                       cost).summary()  # fmt: skip
    assert summary["completed"] == 16
    assert summary["rejected_by_reason"] == {"queue_full": 24}
    assert summary["requests_per_worker"] == {"p0": 8, "p1": 8}


def test_with_prefill_overflow_the_decode_worker_computes_what_the_budgets_leave(
    cost: LinearCost,
):
    """The same burst with prefill_overflow "decode": 3 + 3 prompts go to the prefill
    workers, 3 more (its own 300-token budget) whole to the decode worker, 10 wait (and go to
    whichever worker's budget frees first) and the other 21 are rejected."""
    admission = AdmissionSettings(prefill_token_budget=300, max_queued_requests=10,
                                  max_queue_wait_s=1000.0, prefill_overflow="decode")  # fmt: skip
    load = OpenLoop(0.0, 10.0, bursts_s=(1.0,), burst_size=40)
    result = simulate(Scenario("burst", pd_cluster(admission=admission), PROMPT_100, load), cost)
    summary = result.summary()
    assert summary["rejected_by_reason"] == {"queue_full": 21}
    assert summary["completed"] == 19
    assert summary["requests_per_worker"] == {"p0": 6, "p1": 6, "d0": 7}
    assert {r.decode_worker for r in result.records if r.status == 200} == {"d0"}
    assert {r.num_output_tokens for r in result.records if r.status == 200} == {5}


def test_two_router_replicas_hold_each_worker_within_its_budget_plus_one_request_each(
    cost: LinearCost,
):
    """The same burst split over two routers: each places one request per worker before the
    other hears of it (the fence), queues 10 and rejects the rest; no worker is ever past its
    300 tokens plus one request per router."""
    admission = AdmissionSettings(prefill_token_budget=300, max_queued_requests=10,
                                  max_queue_wait_s=1000.0)  # fmt: skip
    config = replace(pd_cluster(admission=admission), num_routers=2)
    load = OpenLoop(0.0, 10.0, bursts_s=(1.0,), burst_size=40)
    summary = simulate(Scenario("burst", config, PROMPT_100, load), cost).summary()
    assert summary["completed"] == 2 * (2 + 10)
    assert summary["rejected_by_reason"] == {"queue_full": 2 * (20 - 12)}
    assert summary["requests_per_worker"] == {"p0": 12, "p1": 12}
    assert summary["max_over_budget_tokens"] == 0


@pytest.mark.parametrize(
    ("policy", "placed"),
    [
        ("round_robin", {"p0": 60, "p1": 60}),  # blind to speed: half each
        ("watermark", {"p0": 77, "p1": 43}),  # the 2x slower p1 measures fewer tokens/s
        ("hash", {"p0": 55, "p1": 65}),
    ],
)
def test_the_routing_policy_decides_placement_over_a_slow_worker(
    cost: LinearCost, policy: str, placed: dict[str, int]
):
    mix = LengthMix("prefill_mix", scale=0.1, output_tokens=(4, 4))
    config = pd_cluster(slow=2.0, policy=policy)
    summary = simulate(Scenario(policy, config, mix, ClosedLoop(8, 120), seed=3), cost).summary()
    assert summary["completed"] == 120
    assert summary["requests_per_worker"] == placed


def test_the_same_seed_gives_the_same_run_and_another_seed_does_not(cost: LinearCost):
    mix = LengthMix("prefill_mix", scale=0.1, output_tokens=(2, 8))

    def run(seed: int) -> list[tuple]:
        result = simulate(Scenario("det", pd_cluster(), mix, OpenLoop(20.0, 3.0), seed), cost)
        return [(r.request_id, r.ttft_s, r.e2e_s, r.prefill_worker) for r in result.records]

    assert run(1) == run(1)
    assert run(1) != run(2)


def _tiny_pool(num_blocks: int, caching: bool) -> ClusterConfig:
    """One aggregated worker; the router reserves only the prompt, so the engine must grow
    each request's KV itself and preempt when the pool runs out."""
    engine = EngineConfig(num_blocks=num_blocks, watermark=1.0, enable_prefix_caching=caching)
    return ClusterConfig((WorkerSpec("c0", "aggregated"),), engine, engine,
                         AdmissionSettings(kv_output_reserve_tokens=0))  # fmt: skip


LONG_OUTPUT = LengthMix("fixed", prompt_tokens=60, output_tokens=(100, 100))


@pytest.mark.parametrize(("num_blocks", "num_preemptions"), [(20, 7), (200, 0)])
def test_the_engine_scheduler_preempts_when_the_block_pool_is_tiny(
    cost: LinearCost, num_blocks: int, num_preemptions: int
):
    """4 requests of 60 + 100 tokens need 40 blocks of 16 at the end: 20 blocks force the
    newest running request out (recomputed later), 200 never do. simulate() also checks
    that every block is free again afterwards."""
    result = simulate(Scenario("tiny", _tiny_pool(num_blocks, caching=False), LONG_OUTPUT,
                               ClosedLoop(4, 8)), cost)  # fmt: skip
    summary = result.summary()
    assert summary["completed"] == 8
    assert summary["num_preemptions"] == num_preemptions


def test_preemption_with_the_prefix_cache_on_does_not_deadlock(cost: LinearCost):
    """Found by the simulator: a waiting head that could not be admitted kept the prefix hits
    it had claimed, and several such heads pinned every block (Scheduler.schedule)."""
    config = replace(_tiny_pool(20, caching=True), max_sim_s=100.0)
    summary = simulate(Scenario("tiny", config, LONG_OUTPUT, ClosedLoop(4, 8)), cost).summary()
    assert summary["completed"] == 8


def test_the_router_meter_counts_collections_inside_router_calls_apart():
    """A collection inside a router call is CPU the call spent but not the router's code (the
    simulated engines' objects are in the same heap); one outside any call counts nowhere."""
    meter = RouterMeter()
    gc.callbacks.append(meter.on_collection)
    try:
        gc.collect()
        assert (meter.cpu_s, meter.gc_s, meter.num_calls) == (0.0, 0.0, 0)
        with meter:
            garbage = [[i] for i in range(200_000)]  # tracked objects for the pass to walk
            gc.collect()
        assert meter.num_calls == 1
        assert 0.0 < meter.gc_s <= meter.cpu_s
        assert meter.router_s == meter.cpu_s - meter.gc_s
        gc_s = meter.gc_s
        gc.collect()
        assert meter.gc_s == gc_s
    finally:
        gc.callbacks.remove(meter.on_collection)
    del garbage


class FailingSource:
    def next(self, client: int = 0):
        raise ValueError("no requests here")


def test_a_simulation_removes_its_collector_hook_even_when_it_fails(cost: LinearCost):
    hooks = list(gc.callbacks)
    simulate(Scenario("idle", pd_cluster(), PROMPT_100, ClosedLoop(1, 1)), cost)
    assert gc.callbacks == hooks
    with pytest.raises(ValueError):
        simulate(Scenario("bad", pd_cluster(), PROMPT_100, ClosedLoop(1, 1)), cost,
                 source=FailingSource())  # fmt: skip
    assert gc.callbacks == hooks
