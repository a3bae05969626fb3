"""The router's kept state against the same state computed from scratch: the ledger's running
totals, each role's views and totals, the pool speed, and the ranked choice, after random
sequences of heartbeats, assignments and releases."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field, replace

import pytest
from router_harness import Clock, pool_of, ticket, with_load, worker

from engine.prefix_hash import prompt_block_hashes
from pdserve.kv_events import CacheUpdate
from router.admission.drain import DrainRates
from router.ledger import Assignment, Ledger, Share
from router.prefix_index import PrefixIndex
from router.routing import build_policies
from router.routing.filters import PrefillBudget
from router.routing.ranking import Ranking
from router.settings import AdmissionSettings, RoutingSettings
from router.workers import WorkerPool

SEEDS = range(6)
# Three prompts of 10 blocks; the second shares the first's leading 5.
PROMPTS = [list(range(160)), [*range(80), *range(500, 580)], list(range(1000, 1160))]
HASHES = [prompt_block_hashes(prompt, 16) for prompt in PROMPTS]


@dataclass
class ScanningLedger:
    """The ledger's definition (its module docstring), computed by scanning every kept
    assignment, with the same retention rule."""

    retention_s: float
    clock: Clock
    kept: dict[str, list[Assignment]] = field(default_factory=dict)

    def add(self, assignment: Assignment) -> None:
        self.kept.setdefault(assignment.worker_id, []).append(assignment)

    def ended(self, assignment: Assignment) -> None:
        self._drop(assignment.worker_id, self.clock() - self.retention_s)

    def corrected(self, worker_id: str, reported: Share, reported_at: float) -> Share:
        self._drop(worker_id, reported_at)
        now, then = self._share(worker_id, self.clock()), self._share(worker_id, reported_at)
        return Share(
            max(now.amount, reported.amount + now.amount - then.amount),
            max(now.count, reported.count + now.count - then.count),
        )

    def _share(self, worker_id: str, t: float) -> Share:
        active = [a for a in self.kept.get(worker_id, []) if a.active_at(t)]
        return Share(sum(a.amount for a in active), sum(a.count for a in active))

    def _drop(self, worker_id: str, before: float) -> None:
        self.kept[worker_id] = [
            a for a in self.kept.get(worker_id, []) if a.ended_at is None or a.ended_at > before
        ]


@pytest.mark.parametrize("seed", SEEDS)
def test_the_ledgers_running_totals_equal_a_scan_of_its_assignments(seed):
    rng = random.Random(seed)
    clock = Clock()
    ledger, scanning = Ledger(retention_s=5.0, clock=clock), ScanningLedger(5.0, clock)
    heartbeat_at = {w: 0.0 for w in "abc"}
    active: list[Assignment] = []
    for _ in range(600):
        clock.now += rng.choice([0.0, 0.1, 0.5, 2.0])
        worker_id = rng.choice("abc")
        step = rng.random()
        if step < 0.35:
            assignment = ledger.add(worker_id, rng.randrange(1, 500), rng.randrange(1, 4))
            scanning.add(assignment)
            active.append(assignment)
        elif step < 0.65 and active:
            assignment = active.pop(rng.randrange(len(active)))
            ledger.end(assignment)
            scanning.ended(assignment)
        else:
            # A heartbeat: from the past, now, or (a worker's clock ahead of ours) the future.
            if rng.random() < 0.5:
                heartbeat_at[worker_id] = clock.now + rng.choice([-1.5, -0.3, 0.0, 0.4])
            reported = Share(rng.randrange(0, 2000), rng.randrange(0, 8))
            at = heartbeat_at[worker_id]
            assert ledger.corrected(worker_id, reported, at) == scanning.corrected(
                worker_id, reported, at
            )
        for w in "abc":
            assert ledger.share(w) == scanning._share(w, clock.now)


def test_a_correction_counts_an_assignment_started_before_a_heartbeat_from_the_future():
    clock = Clock()
    ledger = Ledger(clock=clock)
    clock.now = 10.0
    ledger.corrected("a", Share(0, 0), 12.0)  # the worker's clock is 2 s ahead
    first = ledger.add("a", 300)  # at 10: already in the heartbeat sent at 12
    assert ledger.corrected("a", Share(300, 1), 12.0) == Share(300, 1)
    clock.now = 11.0
    ledger.end(first)  # ended at 11, before 12: the heartbeat no longer counts it either
    assert ledger.corrected("a", Share(300, 1), 12.0) == Share(300, 1)
    assert ledger.share("a") == Share(0, 0)


def random_info(rng: random.Random, role: str, worker_id: str, now_s: float):
    info = worker(
        role, worker_id, tokens_per_s=rng.choice([0.0, 250.0, 1000.0, 1234.5]),
        max_model_len=rng.choice([2048, 8192, 8192]), updated_at=now_s - rng.random(),
    )  # fmt: skip
    info = replace(info, peer_fetch=rng.random() < 0.3)
    total = rng.choice([0, 512, 1024])
    return with_load(
        info, queued_tokens=rng.randrange(0, 3000), waiting_requests=rng.randrange(0, 4),
        running_requests=rng.randrange(0, 6), total_blocks=total,
        free_blocks=rng.randrange(0, total + 1),
    )  # fmt: skip


@pytest.mark.parametrize("seed", SEEDS)
def test_kept_views_totals_and_choices_equal_ones_computed_from_scratch(seed):
    rng = random.Random(seed)
    clock = Clock()
    ledgers = {"prefill": Ledger(clock=clock), "decode": Ledger(clock=clock)}
    pool = WorkerPool(500.0, ledgers=ledgers)
    drain = DrainRates()
    prefixes = PrefixIndex()
    policies = build_policies(
        RoutingSettings("watermark"), AdmissionSettings(prefill_token_budget=2048), prefixes
    )
    ids = {"prefill": ["p0", "p1", "p2", "p3"], "decode": ["d0", "d1"], "aggregated": ["a0", "a1"]}
    infos = {role: {} for role in ids}
    holds: list[tuple[str, Assignment]] = []
    for step in range(400):
        clock.now += rng.choice([0.0, 0.2, 1.0])
        role = rng.choice(list(ids))
        worker_id = rng.choice(ids[role])
        action = rng.random()
        if action < 0.1:  # what the worker's prefix cache holds: a snapshot or a delta
            stored = rng.choice(HASHES)[: rng.randrange(0, 11)]
            evicted = rng.choice(HASHES)[rng.randrange(0, 11) :]
            prefixes.apply(worker_id, f"{step}-0", CacheUpdate(rng.random() < 0.3, stored, evicted))
        elif action < 0.3:  # a heartbeat, a worker joining, or one leaving
            if rng.random() < 0.15:
                infos[role].pop(worker_id, None)
            else:
                infos[role][worker_id] = random_info(rng, role, worker_id, clock.now)
            pool.update(role, list(infos[role].values()))
        elif action < 0.65 and infos[role]:
            side = rng.choice(["prefill", "decode"])
            holds.append((side, pool.assign(side, worker_id, rng.randrange(1, 900))))
            if side == "prefill":
                drain.started(worker_id, clock.now)
        elif holds:
            side, hold = holds.pop(rng.randrange(len(holds)))
            if side == "prefill":
                drain.ended(hold.worker_id, hold.amount, clock.now)
            pool.release(side, hold)

        fresh = WorkerPool(500.0, ledgers=ledgers)
        for r in ids:
            fresh.update(r, list(infos[r].values()))
        hashes = rng.choice(HASHES)
        probe = replace(
            ticket(f"r{step}", rng.choice([16, 160, 700, 1500, 2500, 5000])), block_hashes=hashes,
            held_prefix_tokens=rng.choice([0, 0, 80]),
        )  # fmt: skip
        every_id = {w for r in ids for w in ids[r]}
        assert prefixes.holders(probe) == {
            w for w in every_id if hashes[0] in prefixes.cached_hashes(w)
        }
        for r, policy in (("prefill", policies.prefill), ("decode", policies.decode),
                          ("aggregated", policies.aggregated)):  # fmt: skip
            kept, scratch = pool.role_views(r), fresh.views(r)
            assert list(kept) == list(scratch)
            assert kept.queued_tokens == sum(v.queued_tokens for v in scratch)
            assert kept.free_blocks == sum(v.free_blocks for v in scratch)
            assert kept.total_blocks == sum(v.total_blocks for v in scratch)
            assert kept.largest_total_blocks() == max((v.total_blocks for v in scratch), default=0)
            assert kept.all_report_capacity() == all(v.total_blocks > 0 for v in scratch)
            speeds = [drain.speed(v.worker_id, v.tokens_per_s) for v in scratch]
            assert drain.pool_speed(kept) == math.fsum(speeds)
            # the ranked choice (prefill) and the scanned one (every policy), same worker, alone
            # and spread over the cheapest as among three routers
            for spread in (1, 3):
                assert policy.choose(kept, probe, spread) == policy.choose(
                    list(scratch), probe, spread
                )


def test_a_ranked_choice_that_another_filter_refuses_is_made_by_scanning():
    policies = build_policies(RoutingSettings("watermark"), AdmissionSettings())
    short = worker("prefill", "a", tokens_per_s=1000, max_model_len=1024)  # idle, cheapest
    busy = worker("prefill", "b", tokens_per_s=1000, queued_tokens=500)
    pool = WorkerPool(500.0)
    pool.update("prefill", [short, busy])
    long_prompt = ticket("r", 1500)  # over a's context; the budget leaves b room for it
    assert policies.prefill.choose(pool.role_views("prefill"), ticket("s", 100)).worker_id == "a"
    assert policies.prefill.choose(pool.role_views("prefill"), long_prompt).worker_id == "b"


def test_a_ranking_reads_the_workers_within_the_budget_cheapest_first():
    # (queued tokens, cost) per worker; c is over the budget of 100 and never read.
    loads = {"a": (0, 5.0), "b": (50, 1.0), "c": (150, 0.0), "d": (20, 3.0), "e": (20, 3.0)}
    pool = pool_of(*(worker("prefill", w, queued_tokens=q) for w, (q, _) in loads.items()))
    ranking = Ranking(lambda view: (loads[view.worker_id][1], view.worker_id), PrefillBudget(100))
    for view in pool.role_views("prefill"):
        ranking.changed(None, view)

    def read(keys, past=None):
        key = keys.next(past)
        return None if key is None else key[-1]

    keys = ranking.in_order(ticket("r", 60))  # within 40 queued tokens: a, d and e
    assert [read(keys) for _ in range(4)] == ["d", "e", "a", None]
    keys = ranking.in_order(ticket("r", 10))  # within 90: b too
    assert read(keys) == "b"
    assert read(keys, past=(3.0, "d")) == "e"  # every key up to d's skipped
    assert read(keys, past=(9.0,)) is None  # a's too
    assert read(ranking.in_order(ticket("r", 10)), past=(3.0,)) == "d"  # above (3.0,): d's
    assert ranking.cheapest(ticket("r", 60)).worker_id == "d"


@pytest.mark.parametrize("seed", SEEDS)
def test_the_walked_aggregated_choice_equals_scoring_every_worker(seed):
    """Many aggregated workers of one KV size, most of them idle or alike (ties in own cost and
    in free blocks), the prefill budget and KV room as filters, and prefix holders."""
    rng = random.Random(seed)
    prefixes = PrefixIndex()
    policies = build_policies(
        RoutingSettings("watermark"), AdmissionSettings(prefill_token_budget=2048), prefixes
    )
    pool = WorkerPool(500.0)
    ids = [f"a{i:02d}" for i in range(40)]
    infos = {}
    for step in range(300):
        for worker_id in rng.sample(ids, 5):
            # own costs 0 (idle) or within the KV term's 0.1 of each other (one waiting request,
            # a few tokens), so KV use reorders them; some over the budget
            waiting = rng.choice([0] + [1] * 12 + [2])
            queued = waiting * rng.choice([1, 20, 50, 80, 3000])
            info = worker("aggregated", worker_id, tokens_per_s=rng.choice([500.0, 1000.0]))
            infos[worker_id] = with_load(
                info, queued_tokens=queued, waiting_requests=waiting, total_blocks=1024,
                free_blocks=rng.choice([1024, 1024, 1000, 700, 512, 300, 10]),
            )  # fmt: skip
        pool.update("aggregated", list(infos.values()))
        if rng.random() < 0.2:
            prefixes.apply(rng.choice(ids), f"{step}-0", CacheUpdate(True, HASHES[0][:4]))
        probe = replace(
            ticket(f"r{step}", rng.choice([16, 300, 1500, 2500])),
            block_hashes=rng.choice(HASHES),
        )  # fmt: skip
        views = pool.role_views("aggregated")
        assert policies.aggregated.choose(views, probe) == policies.aggregated.choose(
            list(views), probe
        )


def test_a_worker_that_has_not_measured_counts_at_its_role_s_measured_speed():
    pool = WorkerPool(500.0)

    def speed_of_a(*others: tuple[str, float]) -> float:
        pool.update("prefill", [worker("prefill", "a")]
                    + [worker("prefill", w, tokens_per_s=s) for w, s in others])  # fmt: skip
        view = pool.role_views("prefill").get("a")
        assert view is not None
        return view.tokens_per_s

    assert speed_of_a() == 500.0  # nobody has measured: the configured default
    assert speed_of_a(("b", 600.0), ("c", 900.0)) == 750.0
    assert speed_of_a(("b", 600.0), ("c", 1200.0)) == 900.0  # c's heartbeat: a follows
    assert speed_of_a(("c", 1200.0)) == 1200.0  # b left
    assert speed_of_a() == 500.0


def test_a_fresh_worker_does_not_outscore_a_measured_holder_of_the_prefix():
    # The decode worker chosen holds the prompt's 10 blocks; the holder caches 9 of them and
    # measured 573 tokens/s; the fresh worker would read all 10 from the decode worker (a
    # fetched token is worth 0.9 of a cached one). At the 500 tokens/s default the fresh one's
    # 144 token-equivalents counted for more seconds (0.288) than the holder's 158.4 (0.276).
    prompt = list(range(160))
    hashes = prompt_block_hashes(prompt + [0], 16)
    prefixes = PrefixIndex()
    prefixes.apply("holder", "s-0", CacheUpdate(True, hashes[:9], []))
    policies = build_policies(RoutingSettings("watermark"), AdmissionSettings(), prefixes)
    pool = WorkerPool(500.0)
    pool.update("prefill", [replace(worker("prefill", "fresh"), peer_fetch=True),
                            replace(worker("prefill", "holder", tokens_per_s=573.0),
                                    peer_fetch=True)])  # fmt: skip
    probe = replace(ticket("r", 170), block_hashes=hashes, held_prefix_tokens=160)
    assert policies.prefill.choose(pool.role_views("prefill"), probe).worker_id == "holder"


def test_a_restarted_worker_alone_unmeasured_leaves_its_old_speed_behind():
    # The only measured worker restarts and reports no speed: nobody has measured now, so it
    # counts at the default, not at the mean that still held its own old speed.
    pool = WorkerPool(500.0)
    pool.update("prefill", [worker("prefill", "a", tokens_per_s=900.0)])
    pool.update("prefill", [worker("prefill", "a")])
    view = pool.role_views("prefill").get("a")
    assert view is not None and view.tokens_per_s == 500.0
