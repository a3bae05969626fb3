"""The worker registry against a real Redis server: publish, list, expire, remove."""

from __future__ import annotations

import json
import time

import pytest

from pdserve.redis_server import RedisServer
from pdserve.registry import Heartbeat, Registry, WorkerInfo, WorkerLoad
from tests.waiting import wait_until


@pytest.fixture(scope="module")
def registry():
    with RedisServer() as server:
        yield Registry(server.url)


def info(role: str, worker_id: str, queued_tokens: int = 0) -> WorkerInfo:
    return WorkerInfo(
        role=role, worker_id=worker_id, address=f"127.0.0.1:{5000 + len(worker_id)}",
        metrics_url="http://127.0.0.1:9400/metrics", kv_backend="tcp", max_model_len=8192,
        chunk_size=512, block_size=16,
        load=WorkerLoad(queued_tokens=queued_tokens, total_blocks=64),
    )  # fmt: skip


def test_workers_are_listed_by_role_with_their_load(registry):
    registry.publish(info("prefill", "p1", queued_tokens=300), ttl_s=30)
    registry.publish(info("prefill", "p2"), ttl_s=30)
    registry.publish(info("decode", "d1"), ttl_s=30)
    prefills = registry.workers("prefill")
    assert [(w.worker_id, w.load.queued_tokens) for w in prefills] == [("p1", 300), ("p2", 0)]
    assert [w.worker_id for w in registry.workers("decode")] == ["d1"]
    assert prefills[0].updated_at > 0
    for role, worker_id in (("prefill", "p1"), ("prefill", "p2"), ("decode", "d1")):
        registry.remove(role, worker_id)
    assert registry.workers("prefill") == []


def test_entries_of_older_and_newer_workers_read_alike(registry):
    """Mid-upgrade, a router reads entries written by other versions: a field it does not know
    is ignored, a field the entry lacks takes its default."""
    entry = json.loads(info("prefill", "p1", queued_tokens=300).to_json())
    newer = {**entry, "numa_node": 1, "load": {**entry["load"], "queued_images": 4}}
    older = {**entry, "load": {"queued_tokens": 300, "total_blocks": 64}}
    del older["peer_fetch"], older["max_requests"]
    for raw in (newer, older):
        registry.redis.set("pdserve:workers:prefill:p1", json.dumps(raw), px=30_000)
        assert registry.workers("prefill") == [info("prefill", "p1", queued_tokens=300)]
    registry.remove("prefill", "p1")


def test_an_entry_expires_without_heartbeats(registry):
    # Listed under a TTL no host outlives between two calls; then published again (as a
    # heartbeat does) with a short one, and nothing more: Redis must drop it on its own.
    registry.publish(info("decode", "short-lived"), ttl_s=60)
    assert [w.worker_id for w in registry.workers("decode")] == ["short-lived"]
    registry.publish(info("decode", "short-lived"), ttl_s=0.3)
    wait_until(
        lambda: registry.workers("decode") == [],
        timeout_s=30,
        message=lambda: f"the entry never expired: {registry.workers('decode')}",
    )
    assert registry.workers("decode") == []


def test_a_heartbeat_keeps_the_entry_fresh_and_stop_removes_it(registry):
    load, ttl_s = {"queued": 0}, 0.6
    started = time.time()
    heartbeat = Heartbeat(
        registry, lambda: info("prefill", "hb", queued_tokens=load["queued"]), ttl_s=ttl_s
    ).start()
    load["queued"] = 42

    def published_past_the_ttl() -> WorkerInfo | None:
        """The entry once a heartbeat published it after start()'s entry would have expired:
        past the TTL, only heartbeats keep it alive."""
        entries = registry.workers("prefill")
        if len(entries) == 1 and entries[0].updated_at > started + ttl_s:
            return entries[0]
        return None

    entry = wait_until(
        published_past_the_ttl,
        timeout_s=30,
        message=lambda: f"no heartbeat past the TTL: {registry.workers('prefill')}",
    )
    assert entry.load.queued_tokens == 42
    heartbeat.stop()
    assert registry.workers("prefill") == []
