"""The host KV tier in the simulator: the engine's own tier code over slots that move no bytes,
its copies taking modelled time, its events reaching the router's prefix index."""

from __future__ import annotations

import asyncio

import pytest

from engine import EngineConfig
from router.settings import AdmissionSettings, RoutingSettings
from sim.clock import run_virtual
from sim.cluster import ClusterConfig, Record, Simulation
from sim.scenario import DRAIN_S
from sim.worker import WorkerSpec
from sim.workload import ClosedLoop, Sequential, SimRequest
from tests.sim.conftest import LinearCost

BLOCK_BYTES = 16 * 4096  # LinearCost's KV bytes per token, a block of 16 tokens
A = list(range(1000, 1064))  # 4 full blocks
B = list(range(2000, 2150))  # with its output token, the whole pool of 10 blocks
A_AGAIN = A + list(range(3000, 3032))  # A's 4 blocks, then 2 new ones


def one_worker(tier_slots: int) -> ClusterConfig:
    engine = EngineConfig(num_blocks=10, kv_offload_gb=tier_slots * BLOCK_BYTES / 2**30)
    return ClusterConfig((WorkerSpec("a0", "aggregated"),), engine, engine,
                         AdmissionSettings(), RoutingSettings())  # fmt: skip


def run(config: ClusterConfig, cost: LinearCost):
    """A, then B (which evicts all of A from the pool), then A again with 32 tokens more."""
    requests = [SimRequest(name, prompt, 1)
                for name, prompt in (("a", A), ("b", B), ("a-again", A_AGAIN))]  # fmt: skip

    async def main() -> tuple[dict[str, Record], Simulation]:
        sim = Simulation(config, cost)
        sim.start()
        try:
            await sim.run_closed(ClosedLoop(1, len(requests)), Sequential.of(requests))
            await asyncio.sleep(DRAIN_S)  # the last cache events published
        finally:
            await sim.stop()
        return {r.request_id: r for r in sim.records}, sim

    return run_virtual(main())


def test_a_prefix_evicted_to_the_tier_is_loaded_back_in_modelled_time(cost: LinearCost):
    records, sim = run(one_worker(tier_slots=64), cost)
    engine = sim.workers["a0"].engine
    assert engine.tier is not None
    # B took every block: A's 4 went to the tier. A again loaded them (each into a block
    # that held one of B's 9 full blocks, or the one B left partly filled) and took 2 more.
    assert (engine.tier.stats.num_stored_blocks, engine.tier.stats.num_loaded_blocks) == (9, 4)
    assert engine.kv.stats.num_host_hit_tokens == 64
    # What every router's prefix index says the worker's host tier holds is what it holds.
    assert sim.routers[0].prefixes.host_cached_hashes("a0") == frozenset(engine.tier.hash_to_slot)

    without, _ = run(one_worker(tier_slots=0), cost)
    # Without the tier A again computes 96 tokens (10 + 96 ms); with it 32, and its step
    # also copies 9 blocks (4 loads, 5 evictions of B's): 10 + 32 + 9 ms.
    saved_s = without["a-again"].ttft_s - records["a-again"].ttft_s
    assert saved_s == pytest.approx(0.106 - 0.051)
    # B's own step stored A's 4 blocks first.
    assert records["b"].ttft_s - without["b"].ttft_s == pytest.approx(0.004)
