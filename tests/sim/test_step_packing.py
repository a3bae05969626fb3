"""How the engine's scheduler packs prompts that arrive together, over the simulator's
cost-model runner (the real LLMEngine, stepped by hand): a burst one step could take is split
by the step's fixed cost in prompt tokens (EngineConfig.step_overhead_tokens); a backlog, and
a GPU's default (0: not weighed), pack every prompt that fits."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace

import pytest

from engine import EngineConfig, SamplingParams
from engine.config import CPU_STEP_OVERHEAD_TOKENS, step_overhead_tokens_for
from sim.clock import VirtualTimeLoop
from sim.worker import SimWorker, WorkerSpec
from tests.sim.conftest import LinearCost

PARAMS = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)


@pytest.fixture
def loop() -> Iterator[VirtualTimeLoop]:
    """Never run: the tests step the engine by hand."""
    loop = VirtualTimeLoop()
    yield loop
    loop.close()


def worker(loop: VirtualTimeLoop, **settings) -> SimWorker:
    config = EngineConfig(num_blocks=256, **settings)  # steps of 512 tokens
    return SimWorker(WorkerSpec("w", "aggregated"), config, LinearCost(), loop)


def step(worker: SimWorker) -> None:
    worker.engine.step()
    worker.clock.offset_s = 0.0  # the step is over: its modelled time leaves the clock


def burst(worker: SimWorker, num_tokens: int, prefix: list[int] | None = None) -> list:
    """Four prompts of num_tokens tokens of their own, after a shared prefix if given."""
    return [
        worker.engine.add_request(
            f"b{i}",
            (prefix or []) + list(range(20_000 + 1000 * i, 20_000 + 1000 * i + num_tokens)),
            PARAMS,
        )
        for i in range(4)
    ]


def computed(requests) -> list[int]:
    return [r.num_computed_tokens for r in requests]


def test_where_compute_dominates_a_burst_takes_a_step_per_prompt(loop):
    # A step's fixed cost is 10 tokens' worth: a second 48-token prompt would delay the first
    # by 48 tokens' compute to save the three waiting 30. Each gets its token a step apart.
    w = worker(loop, step_overhead_tokens=10)
    prompts = burst(w, 48)
    step(w)
    assert computed(prompts) == [48, 0, 0, 0]
    step(w)
    assert computed(prompts) == [49, 48, 0, 0]
    step(w)
    assert computed(prompts) == [49, 49, 48, 0]
    step(w)
    assert computed(prompts) == [49, 49, 49, 48]


def test_where_the_fixed_cost_dominates_a_burst_packs_until_a_prompt_costs_more(loop):
    # 100 tokens' worth: prompts join while (1 + waiting behind) x 100 >= (in the step) x 48:
    # the second (300 >= 48) and the third (200 >= 96); not the fourth (100 < 144).
    w = worker(loop, step_overhead_tokens=100)
    prompts = burst(w, 48)
    step(w)
    assert computed(prompts) == [48, 48, 48, 0]
    step(w)
    assert computed(prompts) == [49, 49, 49, 48]


def test_a_burst_is_weighed_by_the_tokens_it_computes_past_a_cached_prefix(loop):
    # Four 448-token prompts behind a cached 400-token prefix compute 48 tokens each, as the
    # burst above: 192 tokens are no backlog, and they pack 3 then 1. Weighed by their whole
    # prompts (1,792 tokens) they would be a backlog and all four would join.
    w = worker(loop, step_overhead_tokens=100)
    prefix = list(range(5_000, 5_400))  # 25 full blocks
    w.engine.add_request("warm", [*prefix, 1], PARAMS)
    while w.engine.has_unfinished_requests():
        step(w)
    prompts = burst(w, 48, prefix)
    step(w)
    assert computed(prompts) == [448, 448, 448, 0]


def test_a_backlog_packs_the_step(loop):
    # 800 prompt tokens are more than a step takes: every prompt that fits joins.
    w = worker(loop, step_overhead_tokens=10)
    prompts = burst(w, 200)
    step(w)
    assert computed(prompts) == [200, 200, 112, 0]


def test_by_default_the_engine_weighs_the_modelled_device_s_step_overhead(loop):
    # The config's None: the cost model's device's value, not this host's. LinearCost's is a
    # GPU's, 0: the burst packs; a device whose step costs 10 tokens' worth splits it.
    w = worker(loop)
    prompts = burst(w, 48)
    step(w)
    assert computed(prompts) == [48, 48, 48, 48]
    cpu_like = replace(LinearCost(), step_overhead_tokens=10)
    w = SimWorker(WorkerSpec("w", "aggregated"), EngineConfig(num_blocks=256), cpu_like, loop)
    prompts = burst(w, 48)
    step(w)
    assert computed(prompts) == [48, 0, 0, 0]


def test_the_device_s_step_overhead_is_a_cpu_s_on_a_cpu_and_none_on_a_gpu():
    assert EngineConfig(device="cpu").step_overhead_tokens is None  # read by the scheduler
    assert step_overhead_tokens_for("cpu") == CPU_STEP_OVERHEAD_TOKENS == 16
    assert step_overhead_tokens_for("cuda:0") == 0
