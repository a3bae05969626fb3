"""A router's pool across registry outages, against a real Redis server: a restart that loses
every entry keeps the workers in rotation until their own TTLs pass; a worker that leaves on
purpose is gone at once."""

from __future__ import annotations

import asyncio

import pytest
import redis
from router_harness import worker

from pdserve.redis_server import RedisServer, free_port
from pdserve.registry import Registry
from router.workers import WorkerPool


def ids(pool: WorkerPool, role: str) -> list[str]:
    return [info.worker_id for info in pool.infos(role)]


@pytest.fixture
def port():
    return free_port()


def test_a_redis_restart_keeps_the_lost_entries_until_their_ttls_pass(port):
    pool = WorkerPool(500.0)
    server = RedisServer(port=port)
    try:
        registry = Registry(server.url)
        registry.publish(worker("prefill", "p0"), ttl_s=60)
        registry.publish(worker("decode", "d0"), ttl_s=60)
        registry.publish(worker("decode", "d-short"), ttl_s=1.0)
        asyncio.run(pool.refresh(registry))
        assert (ids(pool, "prefill"), ids(pool, "decode")) == (["p0"], ["d-short", "d0"])
        published_at = pool.role_views("decode").get("d-short").info.updated_at
        pool.clock = lambda: published_at + 0.5  # within d-short's TTL, whatever the host
        server.stop()
        server = RedisServer(port=port)  # empty, as after a restart without persistence
        asyncio.run(pool.refresh(registry))
        assert (ids(pool, "prefill"), ids(pool, "decode")) == (["p0"], ["d-short", "d0"])
        # p0 publishes again, with a newer load: that entry is the one followed now.
        registry.publish(worker("prefill", "p0", queued_tokens=300), ttl_s=60)
        asyncio.run(pool.refresh(registry))
        assert pool.views("prefill")[0].queued_tokens == 300
        # d-short never comes back: it leaves when its own TTL has passed.
        pool.clock = lambda: published_at + 1.5
        asyncio.run(pool.refresh(registry))
        assert ids(pool, "decode") == ["d0"]
        # A worker leaving on purpose, with Redis up all along, is gone at the next refresh;
        # p0, back in Redis, is no longer carried.
        registry.remove("prefill", "p0")
        asyncio.run(pool.refresh(registry))
        assert (ids(pool, "prefill"), ids(pool, "decode")) == ([], ["d0"])
    finally:
        server.stop()


def test_an_unreachable_redis_leaves_the_last_snapshot_in_place(port):
    pool = WorkerPool(500.0)
    with RedisServer(port=port) as server:
        registry = Registry(server.url)
        registry.publish(worker("prefill", "p0"), ttl_s=60)
        asyncio.run(pool.refresh(registry))
    with pytest.raises(redis.ConnectionError):  # what RouterServer._refresh logs and rides out
        asyncio.run(pool.refresh(registry))
    assert ids(pool, "prefill") == ["p0"]
