"""Admission, pure: bucket order, aging, FIFO, budgets and backpressure (no processes)."""

from __future__ import annotations

import asyncio

import pytest
from prometheus_client import REGISTRY
from router_harness import Clock, pool_of, ticket, worker

from router.admission import Admission, AdmissionQueue
from router.errors import InvalidRequestError, OverloadedError, UnavailableError
from router.routing import build_policies
from router.settings import AdmissionSettings, RoutingSettings
from router.ticket import kv_blocks_held

LENGTH_AWARE = AdmissionSettings(medium_delay_s=2.0, long_delay_s=8.0).delays_s()
FIFO = AdmissionSettings(mode="fifo").delays_s()


def service_order(delays, arrivals: list[tuple[str, float, int]]) -> list[str]:
    queue = AdmissionQueue(delays)
    for name, arrival_s, num_tokens in arrivals:
        queue.push(ticket(name, num_tokens, arrival_s=arrival_s))
    return [queue.pop().request_id for _ in range(len(queue))]


ORDERS = [
    pytest.param(
        LENGTH_AWARE,
        [("L1", 0.0, 3000), ("L2", 1.0, 3000), ("S", 2.0, 100)],
        ["S", "L1", "L2"],
        id="short-overtakes-queued-longs",
    ),
    pytest.param(
        LENGTH_AWARE,
        [("L", 0.0, 3000), ("M", 0.5, 1000), ("S", 1.0, 100)],
        ["S", "M", "L"],
        id="short-then-medium-then-long",
    ),
    pytest.param(
        LENGTH_AWARE,
        [("L", 0.0, 3000), ("S", 9.0, 100)],
        ["L", "S"],
        id="a-long-that-waited-its-delay-goes-first",
    ),
    pytest.param(
        FIFO,
        [("L1", 0.0, 3000), ("L2", 1.0, 3000), ("S", 2.0, 100)],
        ["L1", "L2", "S"],
        id="fifo-is-arrival-order",
    ),
]


@pytest.mark.parametrize("delays, arrivals, expected", ORDERS)
def test_service_order(delays, arrivals, expected):
    assert service_order(delays, arrivals) == expected


AGING = [
    # (long delay, shorts served before the long one) with a short arriving every second
    pytest.param(0.0, 0, id="no-delay"),
    pytest.param(4.0, 3, id="4s"),
    pytest.param(8.0, 7, id="8s"),
]


@pytest.mark.parametrize("long_delay_s, num_overtaking", AGING)
def test_aging_bounds_how_many_later_shorts_overtake_a_long_request(long_delay_s, num_overtaking):
    delays = AdmissionSettings(long_delay_s=long_delay_s).delays_s()
    shorts = [(f"S{t}", float(t), 100) for t in range(1, 31)]
    order = service_order(delays, [("L", 0.0, 3000), *shorts])
    # Its wait is bounded: only requests arriving within its delay overtake it.
    assert order.index("L") == num_overtaking
    assert order[: num_overtaking + 1] == [*(f"S{t}" for t in range(1, num_overtaking + 1)), "L"]


def test_tokens_ahead_counts_only_requests_served_earlier():
    queue = AdmissionQueue(LENGTH_AWARE)
    long_, short = ticket("L", 3000, arrival_s=0.0), ticket("S", 100, arrival_s=1.0)
    queue.push(long_)
    queue.push(short)
    assert queue.tokens_ahead(short) == 0
    assert queue.tokens_ahead(long_) == 100


def test_the_queued_prompt_tokens_follow_push_pop_and_remove():
    queue = AdmissionQueue(LENGTH_AWARE)
    long_, medium, short = (ticket("L", 3000), ticket("M", 1000), ticket("S", 100))
    for t in (long_, medium, short):
        queue.push(t)
    assert queue.num_prompt_tokens == 4100
    assert queue.pop() is short and queue.num_prompt_tokens == 4000
    assert queue.remove(long_) and queue.num_prompt_tokens == 1000
    assert not queue.remove(long_) and queue.num_prompt_tokens == 1000


def test_tokens_ahead_is_counted_again_once_the_queue_changes():
    queue = AdmissionQueue(LENGTH_AWARE)
    first, second = ticket("A", 100, arrival_s=0.0), ticket("B", 200, arrival_s=1.0)
    probe = ticket("P", 50, arrival_s=2.0)
    queue.push(first)
    assert [queue.tokens_ahead(probe), queue.tokens_ahead(probe)] == [100, 100]
    queue.push(second)
    assert queue.tokens_ahead(probe) == 300
    assert queue.pop() is first
    assert queue.tokens_ahead(probe) == 200
    assert queue.remove(second)
    assert queue.tokens_ahead(probe) == 0


def test_a_request_pushed_again_goes_back_to_its_place_by_arrival():
    """A retry keeps its ticket's arrival: later arrivals of its bucket do not overtake it,
    so its aging bound holds."""
    queue = AdmissionQueue(FIFO)
    for name, arrival_s in (("B", 1.0), ("C", 2.0), ("A", 0.5)):  # A: a retry, arrived first
        queue.push(ticket(name, 100 * (ord(name) - 64), arrival_s=arrival_s))
    assert queue.tokens_ahead(ticket("P", 10, arrival_s=1.5)) == 300  # A and B
    assert [queue.pop().request_id for _ in range(3)] == ["A", "B", "C"]


def test_tokens_ahead_and_the_order_match_a_scan_of_the_queue_through_any_changes():
    """Random pushes (some arriving out of order), pops and removals: the order served and
    every answer of tokens_ahead equal a plain scan of what is queued."""
    import random

    rng = random.Random(7)
    queue = AdmissionQueue(LENGTH_AWARE)
    queued: dict[str, tuple[tuple[float, float, int, int], object]] = {}
    served: list[str] = []
    for step in range(600):
        action = rng.random()
        if action < 0.5 or not queued:
            arrival_s = step * 0.1 - (rng.random() * 30 if rng.random() < 0.1 else 0.0)
            t = ticket(f"r{step}", rng.choice([50, 700, 3000]), arrival_s=arrival_s)
            bucket_index = ["short", "medium", "long"].index(t.bucket)
            order = (arrival_s + LENGTH_AWARE[t.bucket], arrival_s, bucket_index, step)
            queue.push(t)
            queued[t.request_id] = (order, t)
        elif action < 0.75:
            expected = min(queued, key=lambda r: queued[r][0])
            popped = queue.pop()
            served.append(popped.request_id)
            assert popped.request_id == expected
            del queued[expected]
        else:
            _, t = queued.pop(rng.choice(sorted(queued)))
            assert queue.remove(t) and not queue.remove(t)
        probe_order, probe = queued[rng.choice(sorted(queued))] if queued else (None, None)
        if probe is not None:
            ahead = sum(t.num_prompt_tokens for o, t in queued.values() if o < probe_order)
            assert queue.tokens_ahead(probe) == ahead
        assert queue.num_prompt_tokens == sum(t.num_prompt_tokens for _, t in queued.values())
        assert len(queue) == len(queued)
    assert len(served) > 100


# ---- the controller -------------------------------------------------------------------------
def admission(*infos, clock=None, **settings) -> Admission:
    admission_settings = AdmissionSettings(**settings)
    policies = build_policies(RoutingSettings("watermark"), admission_settings)
    return Admission(admission_settings, pool_of(*infos), policies, clock or Clock())


ONE_OF_EACH = (worker("prefill", "p", tokens_per_s=1000), worker("decode", "d"))


def test_short_request_overtakes_queued_long_ones_when_budget_frees():
    async def scenario() -> list[str]:
        adm = admission(*ONE_OF_EACH, prefill_token_budget=1)
        first = await adm.admit(ticket("L0", 3000, arrival_s=0.0))  # the worker was idle
        waiting = [
            asyncio.ensure_future(adm.admit(ticket(name, n, arrival_s=t)))
            for name, n, t in (("L1", 3000, 1.0), ("L2", 3000, 2.0), ("S", 100, 3.0))
        ]
        await asyncio.sleep(0)
        assert [adm.queue.depth(b) for b in ("short", "long")] == [1, 2]
        assert REGISTRY.get_sample_value("pdserve_router_queued_prompt_tokens") == 6100
        served, lease = [], first
        for _ in waiting:
            lease.end_prefill()  # the worker finished a prefill: the next one goes
            await asyncio.sleep(0)
            lease = next(f.result() for f in waiting if f.done() and
                         f.result().ticket.request_id not in served)  # fmt: skip
            served.append(lease.ticket.request_id)
        return served

    assert asyncio.run(scenario()) == ["S", "L1", "L2"]
    assert REGISTRY.get_sample_value("pdserve_router_queued_prompt_tokens") == 0


@pytest.mark.parametrize("overflow", ["queue", "decode"])
def test_prompts_past_every_prefill_budget_wait_or_go_to_a_decode_worker(overflow):
    """prefill_overflow "decode": what the prefill worker's budget leaves goes whole to the
    decode worker, up to the same budget of its own there; "queue": it waits in the router."""

    async def scenario() -> tuple[list[tuple[str, str]], int, int]:
        adm = admission(*ONE_OF_EACH, prefill_token_budget=1000, prefill_overflow=overflow)
        leases = [await adm.admit(ticket(f"r{i}", 400)) for i in range(2)]  # 800 on "p"
        pending = [asyncio.ensure_future(adm.admit(ticket(f"r{i}", 400))) for i in (2, 3, 4)]
        await asyncio.sleep(0)
        leases += [f.result() for f in pending if f.done()]
        decode_view = adm.pool.role_views("decode").get("d")
        assert decode_view is not None
        for f in pending:
            f.cancel()
        return (
            [(lease.prefill.worker_id, lease.decode.worker_id) for lease in leases],
            decode_view.queued_tokens,
            len(adm.queue),
        )

    placed, decode_queued, num_waiting = asyncio.run(scenario())
    if overflow == "queue":
        assert placed == [("p", "d"), ("p", "d")]
        assert (decode_queued, num_waiting) == (0, 3)
    else:  # r2 and r3 fill the decode worker's own 1000-token budget; r4 waits
        assert placed == [("p", "d"), ("p", "d"), ("d", "d"), ("d", "d")]
        assert (decode_queued, num_waiting) == (800, 1)


def test_a_decode_worker_given_a_prompt_drops_it_from_its_prefill_side_at_the_first_token():
    async def scenario() -> list[int]:
        adm = admission(*ONE_OF_EACH, prefill_token_budget=500, prefill_overflow="decode")
        await adm.admit(ticket("on-p", 400))
        lease = await adm.admit(ticket("on-d", 400))
        assert (lease.prefill.worker_id, lease.decode.worker_id) == ("d", "d")
        queued = lambda: adm.pool.role_views("decode").get("d").queued_tokens  # noqa: E731
        before = queued()
        lease.end_prefill()
        return [before, queued()]

    assert asyncio.run(scenario()) == [400, 0]


def test_queue_full_rejects_at_once_with_retry_after():
    async def scenario() -> None:
        adm = admission(*ONE_OF_EACH, prefill_token_budget=1, max_queued_requests=1)
        await adm.admit(ticket("busy", 1000))
        queued = asyncio.ensure_future(adm.admit(ticket("queued", 500)))
        await asyncio.sleep(0)
        with pytest.raises(OverloadedError) as rejected:
            await adm.admit(ticket("excess", 500))
        assert rejected.value.reason == "queue_full"
        # 1000 in the worker + 500 queued ahead + its own 500, less the 1-token budget.
        assert rejected.value.retry_after_s == pytest.approx(1999 / 1000)
        assert rejected.value.retry_after_header == "2"
        assert len(adm.queue) == 1 and not queued.done()
        queued.cancel()

    asyncio.run(scenario())


def test_pass_through_sends_every_request_on_at_once():
    """What a plain Service in front of the workers gives: no prefill budget, KV room or KV
    headroom is checked here, so no request waits in the router; the workers queue them.
    The same cluster refuses the first one at once in FIFO mode (its KV cache is full)."""
    full = (worker("prefill", "p", tokens_per_s=1000), worker("decode", "d", free_blocks=0))

    async def scenario(mode: str) -> list[tuple[str, str]]:
        adm = admission(*full, mode=mode, prefill_token_budget=1)
        leases = [await adm.admit(ticket(f"r{i}", 3000)) for i in range(3)]
        assert len(adm.queue) == 0
        return [(lease.prefill.worker_id, lease.decode.worker_id) for lease in leases]

    assert asyncio.run(scenario("pass_through")) == [("p", "d")] * 3
    with pytest.raises(OverloadedError) as refused:
        asyncio.run(scenario("fifo"))
    assert refused.value.reason == "kv_headroom"


def test_estimated_wait_over_the_limit_rejects_at_once():
    async def scenario() -> None:
        adm = admission(*ONE_OF_EACH, prefill_token_budget=1000, max_queue_wait_s=2.0)
        await adm.admit(ticket("busy", 2500))  # 2500 queued tokens at 1000 tokens/s
        with pytest.raises(OverloadedError) as rejected:
            await adm.admit(ticket("excess", 600))
        assert rejected.value.reason == "queue_wait"
        assert adm.estimated_wait_s(ticket("probe", 600)) == pytest.approx(2.1)
        assert len(adm.queue) == 0
        small = asyncio.ensure_future(adm.admit(ticket("fits-the-limit", 400)))
        await asyncio.sleep(0)
        assert len(adm.queue) == 1  # 1.9 s: it waits instead
        small.cancel()
        await asyncio.sleep(0)
        assert len(adm.queue) == 0  # a cancelled request leaves the queue

    asyncio.run(scenario())


def test_queue_timeout_and_kv_headroom_and_no_workers():
    async def scenario() -> None:
        adm = admission(*ONE_OF_EACH, prefill_token_budget=1, queue_timeout_s=0.05)
        await adm.admit(ticket("busy", 100))
        with pytest.raises(OverloadedError) as timed_out:
            await adm.admit(ticket("late", 100))
        assert timed_out.value.reason == "queue_timeout" and len(adm.queue) == 0

        full = admission(worker("prefill", "p"), worker("decode", "d", free_blocks=40))
        with pytest.raises(OverloadedError) as no_kv:
            await full.admit(ticket("r", 100))
        assert no_kv.value.reason == "kv_headroom"

        with pytest.raises(UnavailableError):
            await admission(worker("prefill", "p")).admit(ticket("r", 100))

    asyncio.run(scenario())


NEVER_FITS = [
    pytest.param(ticket("long", 16400), "1026 KV blocks of 16 tokens (its 16400-token prompt and "
                 "an output reserve)", id="prompt"),
    pytest.param(ticket("wide", 100, max_tokens=800, num_seqs=25), "1281 KV blocks of 16 tokens "
                 "(its 100-token prompt and an output reserve for each of its 25 samples)",
                 id="samples"),
]  # fmt: skip


@pytest.mark.parametrize("huge, needs", NEVER_FITS)
def test_a_kv_hold_larger_than_every_decode_worker_is_refused_at_once(huge, needs):
    async def scenario() -> None:
        adm = admission(worker("prefill", "p"), worker("decode", "d1", total_blocks=512,
                        free_blocks=512), worker("decode", "d2"))  # fmt: skip
        with pytest.raises(InvalidRequestError) as refused:
            await adm.admit(huge)
        assert refused.value.message == (
            f"this request needs {needs}, the largest decode worker has 1024"
        )
        assert refused.value.code == "kv_capacity_exceeded"
        assert len(adm.queue) == 0  # never queued, nothing held
        assert [w.free_blocks for w in adm.pool.views("decode")] == [512, 1024]

    asyncio.run(scenario())


def test_a_hold_that_fits_an_idle_worker_waits_and_an_unknown_capacity_refuses_nothing():
    async def scenario() -> None:
        # 975 blocks: the worker could hold them, once they are free (a busy pool).
        busy = admission(worker("prefill", "p"), worker("decode", "d", free_blocks=900),
                         queue_timeout_s=0.05)  # fmt: skip
        with pytest.raises(OverloadedError) as waited:
            await busy.admit(ticket("wide", 100, max_tokens=800, num_seqs=19))
        assert waited.value.reason == "queue_timeout"
        # A worker that has not reported its capacity yet: no refusal on a guess.
        unknown = admission(worker("prefill", "p"), worker("decode", "d", free_blocks=0,
                            total_blocks=0), queue_timeout_s=0.05)  # fmt: skip
        with pytest.raises(OverloadedError) as waited:
            await unknown.admit(ticket("wide", 100, max_tokens=800, num_seqs=25))
        assert waited.value.reason == "queue_timeout"

    asyncio.run(scenario())


def test_lease_records_queue_wait_and_hands_back_both_workers():
    async def scenario() -> None:
        clock = Clock()
        adm = admission(*ONE_OF_EACH, clock=clock)
        clock.now = 1.5
        lease = await adm.admit(ticket("r", 320, arrival_s=1.0, max_tokens=16))
        assert (lease.prefill.worker_id, lease.decode.worker_id) == ("p", "d")
        assert lease.queue_wait_s == pytest.approx(0.5)
        pool = adm.pool
        assert pool.views("prefill")[0].queued_tokens == 320
        assert pool.views("decode")[0].free_blocks == 1024 - 21
        lease.end_prefill()
        assert pool.views("prefill")[0].queued_tokens == 0
        lease.end()
        lease.end()  # idempotent
        assert pool.views("decode")[0].free_blocks == 1024

    asyncio.run(scenario())


@pytest.mark.parametrize(
    ("num_prompt", "num_output", "num_seqs", "expected"),
    [
        (320, 16, 1, 21),  # 20 full prompt blocks + 1 for the output
        (320, 16, 3, 23),  # the 20 shared, 1 each
        (330, 16, 3, 20 + 3 * 2),  # the partial last prompt block is each sample's own
        (10, 128, 4, 4 * 9),  # no full prompt block to share
    ],
)
def test_kv_hold_shares_the_prompts_full_blocks_among_samples(
    num_prompt, num_output, num_seqs, expected
):
    assert kv_blocks_held(num_prompt, num_output, 16, num_seqs) == expected


def test_a_request_with_n_samples_holds_n_sequences_on_its_decode_worker():
    async def scenario() -> None:
        adm = admission(*ONE_OF_EACH)
        lease = await adm.admit(ticket("r", 320, max_tokens=16, num_seqs=3))
        (decode,) = adm.pool.views("decode")
        assert (decode.running_requests, decode.free_blocks) == (3, 1024 - 23)
        (prefill,) = adm.pool.views("prefill")
        assert prefill.queued_requests == 1  # one prefill for the three
        lease.end()
        (decode,) = adm.pool.views("decode")
        assert (decode.running_requests, decode.free_blocks) == (0, 1024)

    asyncio.run(scenario())


def test_the_tail_margins_percentile_is_statistics_quantiles_to_the_last_bit():
    import random
    import statistics

    from router.admission.ttft_error import percentile

    rng = random.Random(0)
    for n in (2, 3, 10, 57, 100):
        values = [rng.lognormvariate(0.0, 1.0) for _ in range(n)]
        cut_points = statistics.quantiles(values, n=100, method="inclusive")
        for q in (1, 50, 99):
            assert percentile(sorted(values), q) == cut_points[q - 1]


def test_the_tail_margin_reads_the_window_of_the_last_ratios_in_order():
    import random

    from router.admission.ttft_error import TAIL_QUANTILE, TAIL_WINDOW, TTFTCorrection, percentile

    rng = random.Random(0)
    correction = TTFTCorrection(min_predicted_s=0.0)
    for _ in range(3 * TAIL_WINDOW):
        correction.observe(1.0, round(rng.uniform(0.5, 3.0), 1))  # repeats: equal ratios
        window = sorted(correction.ratios)
        assert correction._sorted == window
        if len(window) >= 10:
            expected = max(1.0, percentile(window, TAIL_QUANTILE) / correction.factor)
            assert correction.tail_margin == min(16.0, expected)
