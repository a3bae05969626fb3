"""Router replicas share one view of the cluster: each router tells the others, through Redis,
the assignments it has made (prompt tokens on prefill workers, KV blocks on decode workers,
per worker, active and recently ended), and adds theirs to its own ledgers (ledger.py). The
prefill token budget, the KV headroom and the queue-based TTFT prediction are then
cluster-wide.

A router publishes its whole state, not deltas, so one lost message costs nothing: the next
replaces it. It publishes on every change (at most once per `min_gap_s`, a burst is one
message) and every `ttl_s / 3` while idle, as a Redis PUBLISH (pushed to the peers at once)
and a key with a TTL (what a router starting later reads first). A peer not heard from for
`ttl_s` is gone (killed, or cut from Redis): its assignments are forgotten, and the workers'
heartbeats carry what remains of its work.

Staleness: a peer's assignment reaches this router within min_gap_s + a publish and its push
(a few ms on one network). Inside that window two routers may each place work on the same
worker. To bound that, a router that places a prompt on a prefill worker fences the worker
(WorkerView.fenced: the budget filter refuses it) until a publish that includes it has
reached Redis: each router has at most one request on a worker that the others have not been
told of, so a worker holds at most its prompt-token budget plus one request per router (when
every router takes in a peer's message before that peer's next publish completes: a loop not
stalled for milliseconds). Alone, or while Redis is unreachable, a router fences nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import socket
import time
import uuid
from collections.abc import Callable
from typing import Any

import redis
import redis.asyncio

from router import metrics
from router.ledger import Assignment
from router.workers import WorkerPool

log = logging.getLogger(__name__)

KEY_PREFIX = "pdserve:routers"
CHANNEL = f"{KEY_PREFIX}:assignments"
SIDES = ("prefill", "decode")


def new_router_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


def encode(router_id: str, pool: WorkerPool) -> str:
    """This router's state: per side, [worker, amount, count, started_at, ended_at]."""
    state: dict[str, Any] = {"router_id": router_id, "sent_at": time.time()}
    for side in SIDES:
        state[side] = [
            [a.worker_id, a.amount, a.count, a.started_at, a.ended_at]
            for a in pool.ledgers[side].own()
        ]
    return json.dumps(state, separators=(",", ":"))


def decode(raw: str | bytes) -> tuple[str, dict[str, list[Assignment]]]:
    state = json.loads(raw)
    peer = str(state["router_id"])
    return peer, {
        side: [
            Assignment(
                str(w),
                int(amount),
                float(start),
                None if end is None else float(end),
                int(count),
                owner=peer,
            )  # fmt: skip
            for w, amount, count, start, end in state.get(side, [])
        ]
        for side in SIDES
    }


class ReplicaSync:
    """Keeps this router's peers told of its assignments, and its pool told of theirs."""

    def __init__(
        self, pool: WorkerPool, redis_url: str, on_peer_change: Callable[[], None],
        router_id: str | None = None, ttl_s: float = 2.0, min_gap_s: float = 0.002,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:  # fmt: skip
        self.pool = pool
        self.redis_url = redis_url
        self.on_peer_change = on_peer_change  # a peer's load changed: queued work may fit now
        self.router_id = router_id or new_router_id()
        self.ttl_s = ttl_s
        self.min_gap_s = min_gap_s
        self.clock = clock
        self.heard_at: dict[str, float] = {}  # peer -> clock time of its last message
        self._published = True  # the last publish reached Redis
        self._changed = asyncio.Event()
        self._client: redis.asyncio.Redis | None = None  # run()'s; the simulator needs none

    def key(self) -> str:
        return f"{KEY_PREFIX}:{self.router_id}"

    def changed(self) -> None:
        """This router assigned or released work: tell the peers (soon, batched)."""
        self._changed.set()

    def state(self) -> tuple[str, set[str]]:
        """What to publish now, and the fenced workers whose work it tells of."""
        return encode(self.router_id, self.pool), set(self.pool.fenced)

    def published(self, told: set[str], reached: bool) -> None:
        """A publish of state() ended: it reached Redis, or not (then the peers cannot be told:
        no fence until they can, as they forget this router after ttl_s anyway, or it would
        place one request per worker per try)."""
        self._published = reached
        self._fence_if_told()
        self.pool.unfence(told if reached else set(self.pool.fenced))
        self.on_peer_change()  # the unfenced workers may take queued work

    def take_in(self, raw: str | bytes) -> None:
        """A peer's state, as published."""
        try:
            peer, assignments = decode(raw)
        except (ValueError, KeyError, TypeError) as e:
            log.warning("ignoring a malformed router state: %s", e)
            return
        if peer == self.router_id:
            return
        self.heard_at[peer] = self.clock()
        self._set_peer(peer, assignments)

    async def run(self) -> None:
        """Publishes and listens until cancelled; then removes this router's key."""
        self._client = redis.asyncio.Redis.from_url(self.redis_url, socket_timeout=2.0)
        try:
            await asyncio.gather(self._publish_loop(), self._listen_loop())
        finally:
            with contextlib.suppress(redis.RedisError):  # if not, its TTL removes it
                await self._client.delete(self.key())
            await self._client.aclose()

    async def _publish_loop(self) -> None:
        while True:
            with contextlib.suppress(TimeoutError):  # idle: send the same state again
                await asyncio.wait_for(self._changed.wait(), timeout=self.ttl_s / 3)
            self._changed.clear()
            state, told = self.state()
            assert self._client is not None
            try:
                async with self._client.pipeline(transaction=False) as pipe:
                    pipe.set(self.key(), state, px=int(self.ttl_s * 1000))
                    pipe.publish(CHANNEL, state)
                    await pipe.execute()
                self.published(told, reached=True)
            except redis.RedisError as e:  # the next change or tick sends the whole state again
                metrics.REPLICA_SYNC_FAILURES.labels("publish").inc()
                log.warning("publishing this router's assignments failed: %s", e)
                self.published(told, reached=False)
            await asyncio.sleep(self.min_gap_s)

    async def _listen_loop(self) -> None:
        while True:
            try:
                await self._listen()
            except (redis.RedisError, OSError) as e:  # Redis is away: peers expire meanwhile
                metrics.REPLICA_SYNC_FAILURES.labels("listen").inc()
                log.warning("following the other routers failed: %s", e)
                self._expire_peers()
                await asyncio.sleep(min(1.0, self.ttl_s / 3))

    async def _listen(self) -> None:
        assert self._client is not None
        pubsub = self._client.pubsub(ignore_subscribe_messages=True)
        try:
            await pubsub.subscribe(CHANNEL)
            # Subscribed first, then the keys: a peer's state is never missed in between.
            keys = [k async for k in self._client.scan_iter(match=f"{KEY_PREFIX}:*", count=500)]
            keys = [k for k in keys if k.decode() not in (CHANNEL, self.key())]
            for raw in await self._client.mget(keys) if keys else []:
                if raw is not None:
                    self.take_in(raw)
            while True:
                message = await pubsub.get_message(timeout=self.ttl_s / 3)
                if message is not None and message["type"] == "message":
                    self.take_in(message["data"])
                self._expire_peers()
        finally:
            await pubsub.aclose()

    def _expire_peers(self) -> None:
        now = self.clock()
        for peer in [p for p, at in self.heard_at.items() if now - at > self.ttl_s]:
            log.info("router replica %s went silent: forgetting its assignments", peer)
            del self.heard_at[peer]
            self._set_peer(peer, {side: [] for side in SIDES})

    def _set_peer(self, peer: str, assignments: dict[str, list[Assignment]]) -> None:
        for side in SIDES:
            self.pool.set_peer(side, peer, assignments[side])
        metrics.ROUTER_REPLICAS.set(len(self.heard_at) + 1)
        self._fence_if_told()
        self.on_peer_change()

    def _fence_if_told(self) -> None:
        """Fence prefill workers given work only while there are peers this router can tell;
        alone, or cut from Redis, nothing waits for a publish."""
        self.pool.fencing = bool(self.heard_at) and self._published
        if not self.pool.fencing:
            self.pool.unfence(set(self.pool.fenced))
