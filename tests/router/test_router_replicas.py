"""Router replicas share their assignments: the ledger's peer shares, and two routers' pools
kept in step through a real Redis server."""

from __future__ import annotations

import asyncio
import json
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import pytest
from router_harness import pool_of, ticket, with_load, worker

from pdserve.redis_server import RedisServer
from router.admission import Admission
from router.ledger import Assignment, Share
from router.replicas import CHANNEL, KEY_PREFIX, ReplicaSync, decode, encode
from router.routing import build_policies
from router.settings import AdmissionSettings, RoutingSettings
from tests.waiting import wait_until_async


def test_a_peers_assignments_count_as_this_routers_own_do():
    info = with_load(worker("prefill", "a", updated_at=100.0), queued_tokens=700)
    pool = pool_of(info)
    ledger = pool.ledgers["prefill"]
    ledger.clock = lambda: 150.0
    mine = pool.assign("prefill", "a", 200)
    # The peer's first one started before the heartbeat (already in its 700), its second after,
    # and its third ended before it.
    peer = [Assignment("a", 300, 50.0, owner="r2", serial=1),
            Assignment("a", 100, 120.0, owner="r2", serial=2),
            Assignment("a", 50, 40.0, ended_at=90.0, owner="r2", serial=3)]  # fmt: skip
    pool.set_peer("prefill", "r2", peer)
    assert pool.views("prefill")[0].queued_tokens == 700 + 200 + 100
    assert ledger.share("a") == Share(200, 1)  # this router's own
    assert ledger.routed("a") == Share(600, 3)
    assert ledger.own() == [mine]
    assert ledger.peers() == {"r2"}
    # A delta: its second one ended at 130, and a fourth started.
    changes = [Assignment("a", 100, 120.0, 130.0, owner="r2", serial=2),
               Assignment("a", 20, 140.0, owner="r2", serial=4)]  # fmt: skip
    pool.update_peer("prefill", "r2", changes)
    assert pool.views("prefill")[0].queued_tokens == 700 + 200 + 20
    # Its next full state replaces all: the fourth is gone.
    pool.set_peer("prefill", "r2", [peer[0], Assignment("a", 100, 120.0, 130.0, owner="r2",
                                                        serial=2)])  # fmt: skip
    assert pool.views("prefill")[0].queued_tokens == 700 + 200
    pool.set_peer("prefill", "r2", [])  # the peer is gone
    assert ledger.peers() == set()
    assert pool.views("prefill")[0].queued_tokens == 900  # its 300 is in the 700
    pool.release("prefill", mine)
    assert pool.views("prefill")[0].queued_tokens == 700


def test_a_routers_messages_carry_its_changes_then_its_full_state():
    pool = pool_of(worker("prefill", "p"), worker("decode", "d"))
    sync = ReplicaSync(pool, "redis://unused", lambda: None, router_id="r1")
    pool.on_assign = sync.changed
    pool.assign("prefill", "p", 1500)
    held = pool.assign("decode", "d", 40, count=2)
    pool.release("decode", held)
    raw, told = sync.message(full=False)
    delta = decode(raw)
    assert (delta.peer, delta.seq, delta.full, told) == ("r1", 0, False, set())
    assert [(a.serial, a.worker_id, a.amount, a.count, a.ended_at is None, a.owner)
            for a in delta.sides["prefill"]] == [(1, "p", 1500, 1, True, "r1")]  # fmt: skip
    assert [(a.serial, a.amount, a.count, a.ended_at) for a in delta.sides["decode"]] == [
        (1, 40, 2, held.ended_at)
    ]
    assert decode(sync.message(full=False)[0]).sides == {"prefill": [], "decode": []}
    full = decode(sync.message(full=True)[0])
    assert (full.seq, full.full) == (2, True)
    assert [a.amount for a in full.sides["prefill"]] == [1500]


def test_a_peer_that_misses_a_message_waits_for_the_full_state():
    sender, receiver = pool_of(worker("prefill", "p")), pool_of(worker("prefill", "p"))
    out = ReplicaSync(sender, "redis://unused", lambda: None, router_id="out")
    into = ReplicaSync(receiver, "redis://unused", lambda: None, router_id="in")
    sender.on_assign = out.changed
    into.take_in(out.message(full=True)[0])
    sender.assign("prefill", "p", 100)
    into.take_in(out.message(full=False)[0])
    assert queued(receiver) == 100
    sender.assign("prefill", "p", 200)
    out.message(full=False)  # lost on its way
    sender.assign("prefill", "p", 400)
    into.take_in(out.message(full=False)[0])
    assert queued(receiver) == 100  # the gap: its deltas wait
    into.take_in(out.message(full=True)[0])
    assert queued(receiver) == 700


def test_a_peers_assignments_fill_the_prefill_budget_here():
    policies = build_policies(
        RoutingSettings("watermark"), AdmissionSettings(prefill_token_budget=2048)
    )
    pool = pool_of(worker("prefill", "a"))
    pool.set_peer("prefill", "r2", [Assignment("a", 2000, 1.0, owner="r2")])
    assert policies.prefill.choose(pool.views("prefill"), ticket("r", 100)) is None
    pool.set_peer("prefill", "r2", [])
    assert policies.prefill.choose(pool.views("prefill"), ticket("r", 100)).worker_id == "a"


def test_a_fenced_worker_takes_no_more_until_the_peers_are_told():
    policies = build_policies(
        RoutingSettings("watermark"), AdmissionSettings(prefill_token_budget=2048)
    )
    pool = pool_of(worker("prefill", "a"), worker("prefill", "b", queued_tokens=1000))
    pool.fencing = True
    views = pool.role_views("prefill")  # the ranked placement's path
    assert policies.prefill.choose(views, ticket("r1", 100)).worker_id == "a"
    pool.assign("prefill", "a", 100)
    # a has room for 1,948 more tokens, but its work is not yet told: b takes the next one.
    assert policies.prefill.choose(views, ticket("r2", 100)).worker_id == "b"
    pool.assign("prefill", "b", 100)
    assert policies.prefill.choose(views, ticket("r3", 100)) is None
    pool.unfence({"a"})
    assert policies.prefill.choose(views, ticket("r3", 100)).worker_id == "a"
    assert [v.fenced for v in pool.views("prefill")] == [False, True]


def test_routers_placing_at_once_spread_their_requests_over_as_many_cheapest_workers():
    """With one peer heard, each request goes to one of the two cheapest workers (the same one
    every time for the same request id), so two routers given requests at the same instant
    do not all pick the cheapest; alone, every request goes to the cheapest."""
    policies = build_policies(RoutingSettings("watermark"), AdmissionSettings())
    pool = pool_of(
        worker("prefill", "a"), with_load(worker("prefill", "b"), queued_tokens=100),
        with_load(worker("prefill", "c"), queued_tokens=200),
    )  # fmt: skip
    sync = ReplicaSync(pool, "redis://unused", lambda: None, router_id="r1")
    ids = [f"r{i}" for i in range(40)]

    def choices() -> list[str]:
        return [
            policies.prefill.choose(pool.role_views("prefill"), ticket(i, 100), pool.num_routers)
            .worker_id for i in ids
        ]  # fmt: skip

    assert pool.num_routers == 1
    assert set(choices()) == {"a"}
    sync.take_in(encode("r2", 0, True, {"prefill": [], "decode": []}))
    assert pool.num_routers == 2
    spread = choices()
    assert set(spread) == {"a", "b"}
    assert spread == choices()


def test_a_long_prompt_is_sent_once_the_peers_are_told_of_its_placement():
    """hold(): with a peer to tell, a prompt outside the short bucket waits for the publish
    that tells of it (the next message's, not one already made); a short one never waits."""
    pool = pool_of(worker("prefill", "p"))
    sync = ReplicaSync(pool, "redis://unused", lambda: None, router_id="r1")
    pool.on_assign = sync.changed
    long, short = ticket("l", 3000, bucket="long"), ticket("s", 100, bucket="short")

    async def scenario() -> None:
        await asyncio.wait_for(sync.hold(long), 1.0)  # alone: no one to tell
        sync.take_in(encode("r2", 0, True, {"prefill": [], "decode": []}))
        assert pool.fencing
        pool.assign("prefill", "p", 3000)
        first = asyncio.ensure_future(sync.hold(long))
        await asyncio.wait_for(sync.hold(short), 1.0)
        raw, told = sync.message(full=False)  # tells of the first, not of what comes next
        assert [a.amount for a in decode(raw).sides["prefill"]] == [3000]
        pool.assign("prefill", "p", 2000)
        second = asyncio.ensure_future(sync.hold(long))
        await asyncio.sleep(0)
        assert (first.done(), second.done()) == (False, False)
        sync.published(told, reached=True)
        await asyncio.sleep(0)
        assert (first.done(), second.done()) == (True, False)
        _, told = sync.message(full=False)
        sync.published(told, reached=False)  # the peers cannot be told: nothing waits for it
        await asyncio.sleep(0)
        assert second.done()
        assert not pool.fencing
        await asyncio.wait_for(sync.hold(long), 1.0)

    asyncio.run(scenario())


def test_a_request_cancelled_while_held_gives_its_workers_back():
    policies = build_policies(RoutingSettings("watermark"), AdmissionSettings())
    pool = pool_of(worker("prefill", "p"), worker("decode", "d"))
    admission = Admission(AdmissionSettings(), pool, policies)
    never = asyncio.Event()

    async def held(_ticket) -> None:
        await never.wait()

    admission.before_send = held

    async def scenario() -> None:
        admit = asyncio.ensure_future(admission.admit(ticket("l", 3000, bucket="long")))
        await asyncio.sleep(0)
        assert pool.ledgers["prefill"].share("p") == Share(3000, 1)
        admit.cancel()
        with pytest.raises(asyncio.CancelledError):
            await admit

    asyncio.run(scenario())
    assert pool.ledgers["prefill"].share("p") == Share(0, 0)
    assert pool.ledgers["decode"].share("d") == Share(0, 0)


@pytest.fixture(scope="module")
def redis_url():
    with RedisServer() as server:
        yield server.url


def router_pool():
    return pool_of(worker("prefill", "p"), worker("decode", "d"))


async def started(pool, redis_url, name, ttl_s=2.0):
    changes = []
    sync = ReplicaSync(pool, redis_url, lambda: changes.append(1), router_id=name, ttl_s=ttl_s)
    pool.on_assign = sync.changed
    return sync, asyncio.create_task(sync.run())


def queued(pool) -> int:
    return pool.views("prefill")[0].queued_tokens


def test_routers_see_each_others_assignments_through_redis(redis_url):
    async def scenario():
        a, b = router_pool(), router_pool()
        sync_a, task_a = await started(a, redis_url, "ra")
        sync_b, task_b = await started(b, redis_url, "rb")
        await wait_until_async(
            lambda: "ra" in sync_b.heard_at and "rb" in sync_a.heard_at,
            timeout_s=30,
            message="the routers never heard of each other",
        )
        held = a.assign("prefill", "p", 1500)
        await wait_until_async(
            lambda: queued(b) == 1500,
            timeout_s=30,
            message=lambda: f"b sees {queued(b)} queued tokens",
        )
        blocks = b.assign("decode", "d", 64, count=2)
        await wait_until_async(
            lambda: a.views("decode")[0].free_blocks == 1024 - 64,
            timeout_s=30,
            message="a never saw b's KV blocks",
        )
        assert a.views("decode")[0].running_requests == 2
        a.release("prefill", held)
        await wait_until_async(
            lambda: queued(b) == 0,
            timeout_s=30,
            message=lambda: f"b still sees {queued(b)} queued tokens",
        )
        # A router started later learns the others' state from their keys at once.
        c = router_pool()
        sync_c, task_c = await started(c, redis_url, "rc")
        await wait_until_async(
            lambda: c.views("decode")[0].free_blocks == 1024 - 64,
            timeout_s=30,
            message="c never learnt b's KV blocks",
        )
        b.release("decode", blocks)
        for task in (task_a, task_b, task_c):
            task.cancel()
        await asyncio.gather(task_a, task_b, task_c, return_exceptions=True)

    asyncio.run(scenario())


def test_a_lone_router_publishes_its_full_state_only_until_a_peer_appears(redis_url):
    """Alone, every change waits for the full state (no delta); once it hears of a peer, its
    first message is its full state and each change after it goes out as a delta."""
    import redis.asyncio

    async def messages_of(pubsub, router_id, until):
        seen, deadline_s = [], time.monotonic() + 60
        while not until(seen):
            assert time.monotonic() < deadline_s, f"no message from {router_id} after {seen}"
            raw = await pubsub.get_message(ignore_subscribe_messages=True, timeout=1)
            if raw is None:  # none yet, or the subscription's confirmation
                continue
            message = json.loads(raw["data"])
            if message["router_id"] == router_id:
                seen.append(message)
        return seen

    async def scenario():
        client = redis.asyncio.Redis.from_url(redis_url)
        pubsub = client.pubsub()
        await pubsub.subscribe(CHANNEL)
        a = router_pool()
        sync_a, task_a = await started(a, redis_url, "lone-a", ttl_s=6.0)  # full every 2 s
        await messages_of(pubsub, "lone-a", lambda seen: len(seen) == 1)
        for _ in range(10):
            a.release("prefill", a.assign("prefill", "p", 100))
        held = a.assign("prefill", "p", 700)
        # Until a full state tells of the last one, no message goes out: none is a delta.
        seen = await messages_of(pubsub, "lone-a", lambda seen: any(
            held.serial in [s[0] for s in m["prefill"]] for m in seen))  # fmt: skip
        assert [m["full"] for m in seen] == [True] * len(seen)
        # A peer appears; "lone-a" hears of it and answers with its full state.
        b = router_pool()
        sync_b, task_b = await started(b, redis_url, "peer-b", ttl_s=60.0)
        await messages_of(pubsub, "lone-a", lambda seen: seen and seen[-1]["full"]
                          and "peer-b" in sync_a.heard_at)  # fmt: skip
        await wait_until_async(lambda: queued(b) == 700, timeout_s=30,
                               message=lambda: f"b sees {queued(b)} queued tokens")  # fmt: skip
        # Now a change goes out at once, as a delta.
        second = a.assign("prefill", "p", 50)
        [message] = await messages_of(pubsub, "lone-a", lambda seen: len(seen) == 1)
        assert (message["full"], [s[0] for s in message["prefill"]]) == (False, [second.serial])
        await wait_until_async(lambda: queued(b) == 750, timeout_s=30,
                               message=lambda: f"b sees {queued(b)} queued tokens")  # fmt: skip
        for task in (task_a, task_b):
            task.cancel()
        await asyncio.gather(task_a, task_b, return_exceptions=True)
        await pubsub.aclose()
        await client.aclose()

    asyncio.run(scenario())


@dataclass
class SwallowedCancel:
    """swallow_a_cancel_after_next_publish's record: set once the publish reached Redis, and
    whether a cancellation was then swallowed there."""

    in_publish: asyncio.Event = field(default_factory=asyncio.Event)
    swallowed: bool = False


def swallow_a_cancel_after_next_publish(sync: ReplicaSync) -> SwallowedCancel:
    """Makes the router's next publish, once it reached Redis, swallow the cancellation that
    lands then (as a redis-py call can on Python 3.11)."""
    trap = SwallowedCancel()
    assert sync._client is not None
    make_pipeline = sync._client.pipeline

    def pipeline(*args, **kwargs):
        pipe = make_pipeline(*args, **kwargs)
        execute = pipe.execute

        async def execute_then_swallow_a_cancel():
            result = await execute()
            if not trap.in_publish.is_set():
                trap.in_publish.set()
                try:
                    await asyncio.Event().wait()
                except asyncio.CancelledError:
                    trap.swallowed = True
            return result

        pipe.execute = execute_then_swallow_a_cancel
        return pipe

    sync._client.pipeline = pipeline
    return trap


@pytest.mark.parametrize("swallowed", [False, True], ids=["cancelled", "cancel-swallowed"])
def test_a_stopped_router_is_forgotten_with_its_assignments(redis_url, swallowed):
    """Its task cancelled (as a router killed without a word), a router publishes nothing more
    and its key is gone, even when a redis-py call swallowed the cancellation; the other
    forgets it and its assignments."""

    async def scenario():
        import redis.asyncio

        a, b = router_pool(), router_pool()
        sync_a, task_a = await started(a, redis_url, f"quiet-a-{swallowed}", ttl_s=0.6)
        sync_b, task_b = await started(b, redis_url, f"quiet-b-{swallowed}", ttl_s=0.6)
        a.assign("prefill", "p", 900)
        await wait_until_async(
            lambda: queued(b) == 900, timeout_s=30, message="b never saw a's assignment"
        )
        trap = swallow_a_cancel_after_next_publish(sync_a) if swallowed else None
        if trap is not None:
            a.assign("prefill", "p", 100)
            await asyncio.wait_for(trap.in_publish.wait(), 30)
        task_a.cancel()
        await asyncio.gather(task_a, return_exceptions=True)
        assert trap is None or trap.swallowed
        client = redis.asyncio.Redis.from_url(redis_url)
        assert await client.exists(sync_a.key()) == 0
        await wait_until_async(
            lambda: sync_a.router_id not in sync_b.heard_at,
            timeout_s=30,
            message="b still hears the stopped router",
        )
        assert queued(b) == 0 and await client.exists(sync_a.key()) == 0
        await client.aclose()
        task_b.cancel()
        await asyncio.gather(task_b, return_exceptions=True)

    asyncio.run(scenario())


def test_a_malformed_state_is_ignored(redis_url):
    async def scenario():
        import redis.asyncio

        b = router_pool()
        sync_b, task_b = await started(b, redis_url, "strict-b")
        client = redis.asyncio.Redis.from_url(redis_url)
        await client.set(f"{KEY_PREFIX}:junk", "not json")
        # Redis drops a message published before anyone subscribes: wait for b's subscription.
        listeners = redis.Redis.from_url(redis_url)
        await wait_until_async(
            lambda: listeners.pubsub_numsub(CHANNEL)[0][1],
            timeout_s=30,
            message="b never subscribed",
        )
        listeners.close()
        await client.publish(
            CHANNEL,
            json.dumps({"router_id": "x", "seq": 0, "full": True, "prefill": [[1]]}),
        )
        await client.publish(CHANNEL, encode("good", 0, True, {}))
        await wait_until_async(
            lambda: "good" in sync_b.heard_at,
            timeout_s=30,
            message="a well-formed state after malformed ones was lost",
        )
        assert "x" not in sync_b.heard_at and queued(b) == 0
        await client.delete(f"{KEY_PREFIX}:junk")
        await client.aclose()
        task_b.cancel()
        await asyncio.gather(task_b, return_exceptions=True)

    asyncio.run(scenario())


def test_a_replica_queues_behind_the_work_another_router_placed(start_router):
    """Two routers on the real cluster, each with a one-request prefill budget: while one
    router's long prompt is in prefill, the other sees it and queues its own request."""
    import httpx
    import openai
    from router_harness import MODEL
    from test_router_backpressure import SATURATING, admin, long_prompt, num_queued

    from tests.waiting import wait_until

    first, second = start_router(admission=SATURATING), start_router(admission=SATURATING)

    def prefill_seen_by_second() -> dict:
        (prefill,) = [w for w in admin(second)["workers"] if w["role"] == "prefill"]
        return prefill

    ask = {"model": MODEL, "max_tokens": 4, "temperature": 0}
    clients = [openai.OpenAI(base_url=f"{r.http_url}/v1", api_key="none", max_retries=0,
                             timeout=180) for r in (first, second)]  # fmt: skip
    with ThreadPoolExecutor(2) as pool:
        blocker = pool.submit(clients[0].completions.create, prompt=long_prompt(), **ask)
        wait_until(
            lambda: prefill_seen_by_second()["assigned_by_replicas"]["requests"] == 1,
            timeout_s=60, interval_s=0.02,
            message=lambda: f"the second router sees {prefill_seen_by_second()}",
        )  # fmt: skip
        assert prefill_seen_by_second()["assigned_here"] == {"amount": 0, "requests": 0}
        queued = pool.submit(clients[1].completions.create, prompt="One, two, three,", **ask)
        wait_until(lambda: num_queued(second) == 1, timeout_s=60, interval_s=0.02,
                   message="the second router did not queue behind the first's prompt")  # fmt: skip
        done = [blocker.result(timeout=180), queued.result(timeout=180)]
    assert [c.choices[0].finish_reason for c in done] == ["length", "length"]
    assert [c.usage.completion_tokens for c in done] == [4, 4]
    wait_until(lambda: prefill_seen_by_second()["assigned_by_replicas"]["requests"] == 0,
               timeout_s=60, message="the first router's finished work is still seen")  # fmt: skip
    httpx.get(f"{second.http_url}/health", timeout=10).raise_for_status()
