"""The host KV tier in the simulator: the engine's own tier code over slots that move no bytes,
its copies taking modelled time, its events reaching the router's prefix index."""

from __future__ import annotations

import pytest

from engine import EngineConfig
from pdserve.worker_runtime import registry_entry
from router.settings import AdmissionSettings, RoutingSettings
from sim.cluster import ClusterConfig
from sim.scenario import Result, Scenario, simulate
from sim.worker import WorkerSpec
from sim.workload import ClosedLoop, LengthMix, Sequential, SimRequest
from tests.sim.conftest import LinearCost

BLOCK_BYTES = 16 * 4096  # LinearCost's KV bytes per token, a block of 16 tokens
A = list(range(1000, 1064))  # 4 full blocks
B = list(range(2000, 2150))  # with its output token, the whole pool of 10 blocks
A_AGAIN = A + list(range(3000, 3032))  # A's 4 blocks, then 2 new ones


def one_worker(tier_slots: int) -> ClusterConfig:
    engine = EngineConfig(num_blocks=10, kv_offload_gb=tier_slots * BLOCK_BYTES / 2**30)
    return ClusterConfig((WorkerSpec("a0", "aggregated"),), engine, engine,
                         AdmissionSettings(), RoutingSettings())  # fmt: skip


def run(config: ClusterConfig, cost: LinearCost) -> Result:
    """A, then B (which evicts all of A from the pool), then A again with 32 tokens more."""
    requests = [SimRequest(name, prompt, 1)
                for name, prompt in (("a", A), ("b", B), ("a-again", A_AGAIN))]  # fmt: skip
    return simulate(Scenario("tier", config, LengthMix(), ClosedLoop(1, len(requests))), cost,
                    source=Sequential.of(requests))  # fmt: skip


def ttft_s(result: Result) -> dict[str, float | None]:
    return {r.request_id: r.ttft_s for r in result.records}


def test_a_prefix_evicted_to_the_tier_is_loaded_back_in_modelled_time(cost: LinearCost):
    result = run(one_worker(tier_slots=64), cost)
    engine = result.workers["a0"].engine
    assert engine.tier is not None
    # B took every block: A's 4 went to the tier. A again loaded them (each into a block
    # that held one of B's 9 full blocks, or the one B left partly filled) and took 2 more.
    assert (engine.tier.stats.num_stored_blocks, engine.tier.stats.num_loaded_blocks) == (9, 4)
    assert engine.kv.stats.num_host_hit_tokens == 64
    # Each load was timed on the modelled copies (a 65,536 B block at 65.5 MB/s), and that is
    # what the worker's registry entry tells the routers a token costs to load.
    assert engine.tier.load_s_per_block == pytest.approx(0.001)
    entry = registry_entry(engine, engine.stats(), role="aggregated", worker_id="a0",
                           address="sim://a0", metrics_url="", kv_backend="sim",
                           peer_fetch=False)  # fmt: skip
    assert entry.load.host_load_s_per_token == pytest.approx(0.001 / 16)
    # What every router's prefix index says the worker's host tier holds is what it holds.
    index = result.routers[0].prefixes
    assert index.host_cached_hashes("a0") == frozenset(engine.tier.hash_to_slot)

    tier, without = ttft_s(result), ttft_s(run(one_worker(tier_slots=0), cost))
    # Without the tier A again computes 96 tokens (10 + 96 ms); with it 32, and its step
    # also copies 9 blocks (4 loads, 5 evictions of B's): 10 + 32 + 9 ms.
    assert without["a-again"] - tier["a-again"] == pytest.approx(0.106 - 0.051)
    # B's own step stored A's 4 blocks first.
    assert tier["b"] - without["b"] == pytest.approx(0.004)
