"""Prefix-cache events through a real Redis server: a worker's publisher thread writes its
stream, a router's index follows it, rebuilds from it, and forgets a worker that left."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest
import redis

from engine.prefix_hash import hash_block
from pdserve import kv_events
from pdserve.kv_events import (
    SNAPSHOT_EVERY,
    CacheEventPublisher,
    CacheMirror,
    CacheStream,
    CacheUpdate,
    stream_key,
)
from pdserve.redis_server import RedisServer
from router.prefix_index import PrefixIndex, follow
from tests.waiting import wait_until, wait_until_async


def h(i: int) -> bytes:
    return hash_block(None, [i])


@pytest.fixture(scope="module")
def redis_url():
    with RedisServer() as server:
        yield server.url


def entries(client: redis.Redis, worker_id: str) -> list[CacheUpdate]:
    return [CacheUpdate.from_fields(f) for _, f in client.xrange(stream_key(worker_id))]


def test_a_stream_numbers_its_entries_skips_empty_ones_and_snapshots_on_its_cadence():
    """The entries both the publisher (to Redis) and the simulator (to its routers) send."""
    stream = CacheStream()
    first = stream.next_entry(snapshot=True)
    assert first == CacheUpdate(True, (), seq=0)
    stream.written(first)
    stream.mirror.apply([(True, h(1)), (True, h(2)), (False, h(2))])
    delta = stream.next_entry(snapshot=False)
    assert delta == CacheUpdate(False, (h(1),), seq=1)
    stream.written(delta)
    stream.mirror.apply([(True, h(3)), (False, h(3))])  # came and went: nothing to tell
    assert stream.next_entry(snapshot=False) is None
    for i in range(SNAPSHOT_EVERY - 2):  # deltas up to one short of the cadence
        stream.mirror.apply([(True, h(10 + i))])
        stream.written(stream.next_entry(snapshot=stream.snapshot_due))
    assert not stream.snapshot_due
    stream.mirror.apply([(True, h(5))])
    stream.written(stream.next_entry(snapshot=stream.snapshot_due))
    assert stream.snapshot_due
    snapshot = stream.next_entry(snapshot=stream.snapshot_due)
    assert (snapshot.is_snapshot, len(snapshot.stored), snapshot.seq) == (
        True, SNAPSHOT_EVERY, SNAPSHOT_EVERY + 1,
    )  # fmt: skip


def test_a_delta_carries_only_what_changed_since_the_last_entry():
    mirror = CacheMirror()
    mirror.apply([(True, h(1)), (True, h(2)), (False, h(2)), (True, h(3))])
    update = mirror.delta()
    assert (sorted(update.stored), update.evicted) == (sorted([h(1), h(3)]), ())
    mirror.mark_published(update)
    mirror.apply([(False, h(1)), (True, h(1)), (False, h(3)), (True, h(4)), (False, h(4))])
    assert mirror.delta() == CacheUpdate(False, (), (h(3),))


def test_each_tier_has_its_own_hashes_in_a_delta_and_a_snapshot():
    """A block the pool evicts into its host tier: evicted from one, stored in the other."""
    mirror = CacheMirror()
    mirror.apply([(True, h(1)), (True, h(2))])
    mirror.mark_published(mirror.delta())
    mirror.apply([(False, h(1))], [(True, h(1))])
    update = mirror.delta()
    assert update == CacheUpdate(False, (), (h(1),), (h(1),), ())
    assert CacheUpdate.from_fields({k.encode(): v for k, v in update.fields().items()}) == update
    mirror.mark_published(update)
    assert mirror.snapshot() == CacheUpdate(True, (h(2),), host_stored=(h(1),))
    # An entry from a worker without a host tier has no host fields at all.
    assert CacheUpdate.from_fields({b"kind": b"delta", b"stored": h(3)}) == CacheUpdate(
        False, (h(3),)
    )


def test_the_stream_starts_with_a_snapshot_and_batches_a_step_into_one_entry(redis_url):
    client = redis.Redis.from_url(redis_url)
    client.xadd(stream_key("w-restarted"), CacheUpdate(True, (h(7),)).fields())
    publisher = CacheEventPublisher(client, "w-restarted").start()
    try:
        # The previous incarnation's entries are gone: the cache starts empty.
        assert entries(client, "w-restarted") == [CacheUpdate(True, (), seq=0)]
        publisher.submit([(True, h(1)), (True, h(2))])
        publisher.submit([(False, h(2)), (True, h(3))])
        wait_until(
            lambda: len(entries(client, "w-restarted")) == 2,
            timeout_s=30,
            interval_s=0.05,
            message="w-restarted's two entries never showed",
        )
        last = entries(client, "w-restarted")[-1]
        assert (last.is_snapshot, sorted(last.stored), last.evicted) == (
            False, sorted([h(1), h(3)]), (),
        )  # fmt: skip
        assert client.ttl(stream_key("w-restarted")) > 0
    finally:
        publisher.stop()
    assert not client.exists(stream_key("w-restarted"))  # a leaving worker deletes its stream


def test_a_snapshot_follows_every_snapshot_every_deltas(redis_url, monkeypatch):
    monkeypatch.setattr(kv_events, "SNAPSHOT_EVERY", 3)
    client = redis.Redis.from_url(redis_url)
    publisher = CacheEventPublisher(client, "w-snap", batch_s=0.0).start()
    try:
        for i in range(4):
            publisher.submit([(True, h(i))])
            wait_until(
                lambda i=i: len(entries(client, "w-snap")) == i + 2,
                timeout_s=30,
                interval_s=0.05,
                message="w-snap's entries never grew",
            )
        kinds = [(u.is_snapshot, u.seq) for u in entries(client, "w-snap")]
        assert kinds == [(True, 0), (False, 1), (False, 2), (False, 3), (True, 4)]
        assert sorted(entries(client, "w-snap")[-1].stored) == sorted(h(i) for i in range(4))
    finally:
        publisher.stop()


def test_a_stream_lost_with_redis_starts_again_from_a_snapshot(redis_url):
    client = redis.Redis.from_url(redis_url)
    publisher = CacheEventPublisher(client, "w-lost", batch_s=0.0).start()
    try:
        publisher.submit([(True, h(1)), (True, h(2))])
        wait_until(lambda: len(entries(client, "w-lost")) == 2, timeout_s=30,
                   message="w-lost's delta never showed")  # fmt: skip
        client.delete(stream_key("w-lost"))  # what a restarted Redis without persistence has
        publisher.submit([(True, h(3))])
        wait_until(lambda: entries(client, "w-lost"), timeout_s=30,
                   message="w-lost never wrote again")  # fmt: skip
        [first] = entries(client, "w-lost")
        assert (first.is_snapshot, sorted(first.stored), first.seq) == (
            True, sorted([h(1), h(2), h(3)]), 2,
        )  # fmt: skip
    finally:
        publisher.stop()


def test_a_gap_in_the_entry_numbers_makes_the_index_read_the_worker_afresh():
    index = PrefixIndex()
    assert index.apply("w", "1-0", CacheUpdate(True, (h(1),), seq=0))
    assert index.apply("w", "2-0", CacheUpdate(False, (h(2),), seq=1))
    # Entry 2 (which evicted h(1)) was trimmed before the router read it.
    assert not index.apply("w", "4-0", CacheUpdate(False, (h(3),), seq=3))
    assert (index.cached_hashes("w"), index.position("w")) == (frozenset(), "0-0")
    # Read again from the start of the stream: its snapshot, then what follows it.
    assert index.apply("w", "3-0", CacheUpdate(True, (h(2),), seq=2))
    assert index.apply("w", "4-0", CacheUpdate(False, (h(3),), seq=3))
    assert index.cached_hashes("w") == {h(2), h(3)}
    # A snapshot after a gap replaces whatever was missed.
    assert index.apply("w", "9-0", CacheUpdate(True, (h(4),), seq=7))
    assert index.cached_hashes("w") == {h(4)}
    # Unnumbered entries (an older worker's) are applied as they come.
    assert index.apply("old", "1-0", CacheUpdate(True, (h(5),)))
    assert index.apply("old", "9-0", CacheUpdate(False, (h(6),)))
    assert index.cached_hashes("old") == {h(5), h(6)}


def test_the_index_follows_rebuilds_and_forgets_workers(redis_url):
    client = redis.Redis.from_url(redis_url)
    publishers = {w: CacheEventPublisher(client, w).start() for w in ("p-0", "d-0")}
    registered = {"p-0", "d-0"}

    async def scenario() -> None:
        index = PrefixIndex()
        task = asyncio.create_task(follow(index, redis_url, lambda: registered, block_ms=50))

        async def until(condition: Callable[[], bool]) -> None:
            await wait_until_async(condition, timeout_s=30, message="index did not follow")

        publishers["p-0"].submit([(True, h(1)), (True, h(2))])
        publishers["d-0"].submit([(True, h(9))])
        await until(lambda: index.cached_hashes("p-0") == {h(1), h(2)})
        await until(lambda: index.cached_hashes("d-0") == {h(9)})
        publishers["p-0"].submit([(False, h(1))])  # evicted blocks leave the index
        await until(lambda: index.cached_hashes("p-0") == {h(2)})
        # A router started now rebuilds the same index from the streams.
        fresh = PrefixIndex()
        fresh_task = asyncio.create_task(follow(fresh, redis_url, lambda: registered, 50))
        await until(lambda: fresh.cached_hashes("p-0") == {h(2)})
        await until(lambda: fresh.cached_hashes("d-0") == {h(9)})
        registered.discard("d-0")  # it left the registry: its entries go
        await until(lambda: index.cached_hashes("d-0") == frozenset())
        for t in (task, fresh_task):
            t.cancel()
        await asyncio.gather(task, fresh_task, return_exceptions=True)

    try:
        asyncio.run(scenario())
    finally:
        for publisher in publishers.values():
            publisher.stop()


def test_a_cancelled_follower_always_ends(redis_url):
    """The router's shutdown cancels its follower: a cancel that lands anywhere in a blocking
    XREAD must end the task (redis-py swallowed about 1 in 100 of them)."""

    async def cancel_often() -> list[int]:
        stuck = []
        for i in range(150):
            task = asyncio.create_task(follow(PrefixIndex(), redis_url, lambda: {"a"}, 50))
            await asyncio.sleep((i % 25) * 0.005)  # 0 to 120 ms: every phase of the read
            task.cancel()
            done, _ = await asyncio.wait({task}, timeout=30)
            if not done:
                stuck.append(i)
                break
        return stuck

    assert asyncio.run(cancel_often()) == []
