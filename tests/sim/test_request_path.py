"""The request-path functions the services and the simulator share: each rule with exact
numbers, then the simulator's outcome for a scenario that hits it."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from dataclasses import dataclass, field, replace

import pytest

from engine import EngineConfig, SamplingParams
from engine.request import Request
from pdserve.registry import WorkerInfo, WorkerLoad
from pdserve.worker_runtime import registry_entry
from prefill_service.request_path import (
    FetchCosts,
    FetchPlan,
    Shipment,
    first_token_params,
    plan_prefix_fetch,
)
from router.gateway import excluding
from router.settings import AdmissionSettings
from router.workers import WorkerPool
from sim.clock import VirtualTimeLoop, run_virtual
from sim.cluster import ClusterConfig, Simulation
from sim.scenario import Scenario, simulate
from sim.worker import SimWorker, WorkerSpec
from sim.workload import ClosedLoop, LengthMix, Sequential, SimRequest
from tests.engine.kv_state import cached_in_pool
from tests.router import router_harness as harness
from tests.sim.conftest import LinearCost, pd_cluster

# 300 tokens in blocks of 16 are 19 blocks, the last one partial; chunks of 128 compute them
# in three steps: 128, 128, then 44.
CHUNKED = EngineConfig(chunk_size=128)
PROMPT_300 = LengthMix("fixed", prompt_tokens=300, output_tokens=(2, 2))
GREEDY = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)


@dataclass(frozen=True, slots=True)
class SendLog(LinearCost):
    """LinearCost that remembers the tokens of every KV send, in order."""

    sent_tokens: list[int] = field(default_factory=list)

    def kv_transfer_s(self, num_tokens: int) -> float:
        self.sent_tokens.append(num_tokens)
        return self.transfer_s


@pytest.fixture
def loop() -> Iterator[VirtualTimeLoop]:
    """Never run: its clock stays at 0 while the tests step engines by hand."""
    loop = VirtualTimeLoop()
    yield loop
    loop.close()


def _worker(loop: VirtualTimeLoop, spec: WorkerSpec, config: EngineConfig = CHUNKED) -> SimWorker:
    """A simulated worker's real engine, stepped by hand."""
    return SimWorker(spec, config, LinearCost(), loop)


def _run_to_end(worker: SimWorker) -> None:
    while worker.engine.has_unfinished_requests():
        worker.engine.step()


@pytest.mark.parametrize(
    ("asked", "num_prior", "expected"),
    [
        (SamplingParams(max_tokens=50, temperature=0.7, n=4), 0,
         SamplingParams(max_tokens=1, temperature=0.7, n=1)),
        # A moved request: its prior output is in the prompt; min_tokens still binds.
        (SamplingParams(max_tokens=50, min_tokens=3), 5,
         SamplingParams(max_tokens=6, min_tokens=3)),
        (SamplingParams(max_tokens=50, min_tokens=3), 0,
         SamplingParams(max_tokens=1, min_tokens=1)),
    ],
)  # fmt: skip
def test_the_prefill_engine_samples_only_the_first_token(
    asked: SamplingParams, num_prior: int, expected: SamplingParams
):
    assert first_token_params(asked, num_prior) == expected


def test_blocks_leave_as_they_become_final_and_stay_held_until_released(loop: VirtualTimeLoop):
    """Full blocks after each chunk (8, then 8), the partial last one with the last chunk;
    every block sent is held past the request's end until the sender releases it."""
    worker = _worker(loop, WorkerSpec("p0", "prefill"))
    engine = worker.engine
    shipment = Shipment(num_skipped_blocks=0)
    taken: list[slice] = []
    held: list[int] = []

    def ship(request: Request) -> None:
        final = shipment.take_final_blocks(request, engine.kv)
        if final is not None:
            taken.append(final)
            held.extend(request.block_ids[final])

    engine.on_computed = ship
    engine.add_request("r", list(range(100, 400)), first_token_params(GREEDY, 0))
    _run_to_end(worker)
    assert taken == [slice(0, 8), slice(8, 16), slice(16, 19)]
    assert engine.pool.num_free_blocks == engine.pool.num_blocks - 19
    engine.kv.release(held)
    assert engine.pool.num_free_blocks == engine.pool.num_blocks


def test_blocks_the_decode_worker_holds_are_never_sent(loop: VirtualTimeLoop):
    """A decode worker that has the prompt cached holds its first 18 whole blocks (the last
    token is always recomputed); the prefill worker sends only the 19th."""
    decode = _worker(loop, WorkerSpec("d0", "decode"), EngineConfig())
    prompt = list(range(100, 400))
    decode.engine.add_request("earlier", prompt, GREEDY)
    _run_to_end(decode)
    reserved = decode.engine.reserve_for_remote_prefill("r", prompt, GREEDY)
    assert reserved.num_cached_tokens == 288
    assert decode.engine.kv.first_remote_block(reserved) == 18

    prefill = _worker(loop, WorkerSpec("p0", "prefill"))
    shipment = Shipment(num_skipped_blocks=18)
    taken: list[slice | None] = []
    prefill.engine.on_computed = lambda r: taken.append(
        shipment.take_final_blocks(r, prefill.engine.kv)
    )
    prefill.engine.add_request("r", prompt, first_token_params(GREEDY, 0))
    _run_to_end(prefill)
    assert taken == [None, None, slice(18, 19)]


def test_the_simulated_prefill_ships_by_the_same_rule():
    """Two identical 300-token prompts, one after the other: the first goes out as the rule
    above takes it (8, 8, then 3 blocks), the second only as its 19th block, the decode
    worker holding the rest. The prefill worker runs its three chunks and one more step for
    the second prompt's 12 uncached tokens, and never a decode step."""
    log = SendLog()
    config = ClusterConfig(
        (WorkerSpec("p0", "prefill"), WorkerSpec("d0", "decode")), CHUNKED, EngineConfig()
    )
    scenario = Scenario("ship", config, PROMPT_300, ClosedLoop(1, 2), shared_prefix_tokens=300)
    result = simulate(scenario, log)
    assert [r.status for r in result.records] == [200, 200]
    assert log.sent_tokens == [128, 128, 48, 16]
    assert result.workers["p0"].num_steps == 4
    assert [r.num_output_tokens for r in result.records] == [2, 2]


def test_a_registry_entry_carries_the_engine_limits_and_its_stats_snapshot(
    loop: VirtualTimeLoop,
):
    worker = _worker(loop, WorkerSpec("p0", "prefill"))
    engine = worker.engine
    engine.add_request("r", list(range(100, 400)), GREEDY)
    stats = engine.stats()
    engine.step()  # the live engine moves on; the entry shows the snapshot
    entry = registry_entry(
        engine, stats, role="prefill", worker_id="p0", address="10.0.0.1:50061",
        metrics_url="http://10.0.0.1:9100/metrics", kv_backend="tcp", peer_fetch=True,
    )  # fmt: skip
    num_blocks = CHUNKED.num_blocks
    assert entry == WorkerInfo(
        role="prefill", worker_id="p0", address="10.0.0.1:50061",
        metrics_url="http://10.0.0.1:9100/metrics", kv_backend="tcp",
        max_model_len=engine.max_model_len, chunk_size=128, block_size=16,
        load=WorkerLoad(queued_tokens=300, running_requests=0, waiting_requests=1,
                        free_blocks=num_blocks, total_blocks=num_blocks),
        peer_fetch=True,
    )  # fmt: skip
    # What a simulated worker publishes is that entry, stamped with the virtual time (it reads
    # a peer's prefix, as workers do by default).
    worker.stats = stats
    assert worker.info() == replace(
        entry, address="sim://p0", metrics_url="", kv_backend="sim", updated_at=0.0
    )
    # The requests it takes at once: its RPC limit, and a decode worker's max_num_seqs too.
    limits = {
        (role, rpcs): registry_entry(engine, stats, role=role, worker_id="w", address="a",
                                     metrics_url="", kv_backend="tcp", peer_fetch=False,
                                     max_concurrent_rpcs=rpcs).max_requests
        for role in ("prefill", "decode", "aggregated") for rpcs in (0, 32, 128)
    }  # fmt: skip
    seqs = engine.config.max_num_seqs
    assert seqs == 64 and limits == {
        ("prefill", 0): 0, ("prefill", 32): 32, ("prefill", 128): 128,
        ("decode", 0): 64, ("decode", 32): 32, ("decode", 128): 64,
        ("aggregated", 0): 0, ("aggregated", 32): 32, ("aggregated", 128): 128,
    }  # fmt: skip


@dataclass(slots=True)
class Alternating:
    """Short and medium prompts in turn."""

    lengths: tuple[int, ...] = (100, 1000)
    count: int = 0

    def next(self, client: int = 0) -> SimRequest:
        n = self.lengths[self.count % len(self.lengths)]
        self.count += 1
        return SimRequest(f"r{self.count:03d}", list(range(100, 100 + n)), 2, client)


def test_a_mixed_cluster_is_split_by_the_routers_own_pool_rule(cost: LinearCost):
    """Aggregated workers register as such, so the router's rule picks the pool: short
    prompts whole to the aggregated worker, medium ones to the prefill + decode pair."""
    specs = (WorkerSpec("a0", "aggregated"), WorkerSpec("p0", "prefill"),
             WorkerSpec("d0", "decode"))  # fmt: skip
    config = ClusterConfig(specs, EngineConfig(), EngineConfig(), AdmissionSettings())
    scenario = Scenario("mixed", config, PROMPT_300, ClosedLoop(1, 4))
    records = simulate(scenario, cost, source=Alternating()).records  # type: ignore[arg-type]
    assert [(r.num_prompt_tokens, r.prefill_worker, r.decode_worker) for r in records] == [
        (100, "a0", "a0"), (1000, "p0", "d0"), (100, "a0", "a0"), (1000, "p0", "d0"),
    ]  # fmt: skip
    assert [r.status for r in records] == [200] * 4


def test_a_request_past_every_decode_workers_limit_waits_for_one(cost: LinearCost):
    """Decode workers that take one request at a time (max_num_seqs 1, in their registry
    entries), three requests at once: the first two spread over d0 and d1, the third waits in
    the router's queue rather than be sent to be refused, and runs when d0 is free."""
    specs = (WorkerSpec("p0", "prefill"), WorkerSpec("d0", "decode"), WorkerSpec("d1", "decode"))
    config = ClusterConfig(specs, EngineConfig(), EngineConfig(max_num_seqs=1))
    records = simulate(Scenario("waits", config, PROMPT_300, ClosedLoop(3, 3)), cost).records
    assert [(r.status, r.decode_worker) for r in records] == [(200, "d0"), (200, "d1"),
                                                              (200, "d0")]  # fmt: skip
    assert records[2].queue_wait_s > 0 and records[0].queue_wait_s == 0


@pytest.mark.parametrize(
    ("excluded", "moving_from", "expected"),
    [
        (set(), "d0", {"d0"}),
        ({"d0"}, "d1", {"d0", "d1"}),  # the aggregated worker is still left
        ({"d0", "a0"}, "d1", None),
        (set(), "gone", {"gone"}),  # a worker that left the registry meanwhile
    ],
)  # fmt: skip
def test_a_request_moves_on_while_a_decode_side_worker_is_left(
    excluded: set[str], moving_from: str, expected: set[str] | None
):
    pool = WorkerPool(500.0)
    pool.update("decode", [harness.worker("decode", "d0"), harness.worker("decode", "d1")])
    pool.update("aggregated", [harness.worker("aggregated", "a0")])
    ticket = replace(harness.ticket("r", 100), excluded_decode_ids=frozenset(excluded))
    left = excluding(ticket, moving_from, pool)
    assert left == (None if expected is None else frozenset(expected))


def test_the_simulated_routers_learn_every_workers_cache_from_its_stream_entries():
    """A worker's prefix-cache changes reach the routers' prefix index as the CacheStream
    entries the real publisher writes: after a 200-token prompt, its 12 full blocks are held
    by the prefill worker that computed it and by the decode worker it was shipped to."""
    from pdserve.kv_events import BATCH_S

    async def main() -> tuple[str, dict[str, frozenset[bytes]]]:
        sim = Simulation(pd_cluster(2, 1), LinearCost())
        sim.start()
        record = await sim.serve(SimRequest("r", list(range(1000, 1200)), 2))
        await asyncio.sleep(2 * BATCH_S)
        await sim.stop()
        (router,) = sim.routers
        return record.prefill_worker, {w: router.prefixes.cached_hashes(w) for w in sim.workers}

    prefill, cached = run_virtual(main())
    other = ({"p0", "p1"} - {prefill}).pop()
    assert len(cached[prefill]) == 12
    assert cached["d0"] == cached[prefill]
    assert cached[other] == frozenset()


def test_a_prefix_the_decode_worker_holds_past_our_hits_is_read_when_that_is_faster(
    loop: VirtualTimeLoop,
):
    worker = _worker(loop, WorkerSpec("p0", "prefill"))
    engine = worker.engine
    prompt = list(range(1000, 1300))
    engine.add_request("a", prompt[:81], GREEDY)  # caches the first 5 blocks (80 tokens)
    _run_to_end(worker)
    fast = FetchCosts(kv_bytes_per_token=4096, kv_bytes_per_s=1e12)
    plan = plan_prefix_fetch(engine, prompt, 12, fast, prefill_tokens_per_s=100.0)
    assert plan is not None and (len(plan.own_ids), len(plan.dst_ids), plan.refused) == (5, 7, None)
    assert plan.own_ids == cached_in_pool(engine.kv, prompt)
    engine.kv.release(plan.own_ids + plan.dst_ids)  # as the request's end does
    engine.kv.check_integrity()
    assert engine.pool.num_free_blocks == engine.pool.num_blocks
    slow = FetchCosts(kv_bytes_per_token=4096, kv_bytes_per_s=1.0)
    assert plan_prefix_fetch(engine, prompt, 12, slow, 100.0) == FetchPlan(refused="slower")
    assert plan_prefix_fetch(engine, prompt, 5, fast, 100.0) is None  # nothing past our hits


def test_the_simulated_prefill_reads_the_prefix_it_lost_from_the_decode_worker():
    """A 300-token prompt, another that evicts it from the prefill worker's small pool (its
    first blocks first, so no prefix of it is left), then the first again: the decode worker
    still holds its 18 full blocks, so the prefill worker reads them (288 tokens) by the plan
    the service makes, computes only the last 12 tokens in one step, and ships the last
    block."""
    log = SendLog()
    config = ClusterConfig(
        (WorkerSpec("p0", "prefill"), WorkerSpec("d0", "decode")),
        EngineConfig(chunk_size=128, num_blocks=24), EngineConfig(),
    )  # fmt: skip
    first, other = list(range(1000, 1300)), list(range(5000, 5300))
    turns = [[SimRequest(name, prompt, 2)] for name, prompt in
             (("a", first), ("b", other), ("a-again", first))]  # fmt: skip
    scenario = Scenario("fetch", config, PROMPT_300, ClosedLoop(1, 3))
    result = simulate(scenario, log, source=Sequential(turns))
    assert [r.status for r in result.records] == [200, 200, 200]
    assert log.sent_tokens == [128, 128, 48, 128, 128, 48, 288, 16]
    assert result.workers["p0"].num_steps == 3 + 3 + 1
