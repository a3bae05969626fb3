"""The request-level pools: one request's timings by hand, scaling up and down, GPU time."""

from __future__ import annotations

import pytest

from sim.fleet import Fleet, FleetConfig, FleetRequest

CONFIG = FleetConfig(tick_s=0.01, startup_s=1.0)


def run_until_done(fleet: Fleet, limit_s: float = 10.0) -> None:
    while any(r.done_s is None for r in fleet.requests) and fleet.now_s < limit_s:
        fleet.tick()


def test_one_request_end_to_end(cost):
    # LinearCost: prefill of 100 tokens alone = 2 hops (2 ms) + 10 ms + 100 ms; the KV send
    # 5 ms -> first token at 0.117 s. It joins decode at the next tick, 0.12 s; 2 more tokens
    # at 10 ms + 2 ms per step -> done at 0.144 s.
    fleet = Fleet(cost, CONFIG, prefill=1, decode=1)
    fleet.arrive(FleetRequest(0.0, 100, 3))
    run_until_done(fleet)
    [request] = fleet.requests
    assert request.ttft_s == pytest.approx(0.117, abs=1e-9)
    assert request.done_s == pytest.approx(0.144, abs=1e-9)
    assert request.itl_s == pytest.approx(0.0135, abs=1e-9)
    assert request.meets(0.2, 0.02) and not request.meets(0.1, 0.02)


def test_prompts_wait_for_the_first_free_prefill_worker(cost):
    fleet = Fleet(cost, CONFIG, prefill=1, decode=1)
    for _ in range(2):
        fleet.arrive(FleetRequest(0.0, 100, 1))
    run_until_done(fleet)
    ttfts = [r.ttft_s for r in fleet.requests]
    assert ttfts == pytest.approx([0.117, 0.229], abs=1e-9)  # the second starts at 0.112


def test_the_observation_summarises_the_interval(cost):
    fleet = Fleet(cost, CONFIG, prefill=1, decode=1)
    fleet.arrive(FleetRequest(0.0, 100, 3))
    fleet.arrive(FleetRequest(0.0, 300, 1))
    run_until_done(fleet)
    obs = fleet.observe()
    assert (obs.num_requests, obs.prompt_tokens, obs.output_tokens) == (2, 200.0, 2.0)
    assert obs.ttft_s == pytest.approx((0.117 + 0.429) / 2, abs=1e-9)  # 0.112 + 0.317
    assert obs.itl_s == pytest.approx(0.0135, abs=1e-9)
    assert (obs.num_finished, obs.num_met_slo) == (2, 2)
    assert fleet.observe().num_requests == 0  # the next interval starts empty


def test_scaling_up_waits_for_start_up_and_down_drains(cost):
    fleet = Fleet(cost, CONFIG, prefill=1, decode=1)
    fleet.set_replicas("decode", 3)
    assert fleet.replicas() == {"prefill": 1, "decode": 3}
    assert fleet.serving() == {"prefill": 1, "decode": 1}
    for _ in range(100):
        fleet.tick()
    assert fleet.serving() == {"prefill": 1, "decode": 3}
    fleet.set_replicas("decode", 1)
    fleet.tick()  # idle workers retire at once
    assert fleet.replicas() == {"prefill": 1, "decode": 1}
    # GPU time: 2 workers x 1.01 s and the 2 retired ones for 1.01 s each, at 2 GPUs each
    gpus = {"prefill": 2, "decode": 2}
    assert fleet.gpu_seconds(gpus) == pytest.approx(2 * 4 * 1.01, abs=1e-9)


def test_a_draining_decode_worker_finishes_its_requests_first(cost):
    fleet = Fleet(cost, CONFIG, prefill=1, decode=1)
    fleet.arrive(FleetRequest(0.0, 100, 50))
    while not fleet.decode[0].running:
        fleet.tick()
    fleet.set_replicas("decode", 0)
    fleet.tick()
    assert len(fleet.decode) == 1 and fleet.replicas()["decode"] == 0
    run_until_done(fleet)
    fleet.tick()
    assert fleet.decode == [] and fleet.requests[0].done_s is not None


def test_the_backlog_and_the_arriving_prompt_tokens(cost):
    fleet = Fleet(cost, FleetConfig(), prefill=1, decode=1)
    assert fleet.prefill_flow().arriving_tokens_per_s == 0.0  # starts the measure
    for t in (0.0, 0.01):
        fleet.arrive(FleetRequest(t, 3000, 10))
    fleet.tick()  # the first prompt starts at 0, the second waits
    flow = fleet.prefill_flow()
    left = 3000 * (fleet.prefill[0].free_s - fleet.now_s) / fleet.prefill[0].free_s
    assert flow.queued_prompt_tokens == pytest.approx(3000 + left)
    assert flow.arriving_tokens_per_s == pytest.approx(6000 / fleet.config.tick_s)
    assert fleet.observe().queued_prompt_tokens == pytest.approx(3000 + left)
