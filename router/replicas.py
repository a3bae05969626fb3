"""Router replicas share one view of the cluster: each router tells the others, through Redis,
the assignments it makes (prompt tokens on prefill workers, KV blocks on decode workers, per
worker, as they start and end), and adds theirs to its own ledgers (ledger.py). The prefill
token budget, the KV headroom and the queue-based TTFT prediction are then cluster-wide.

A router publishes a message on every change (at most one per `min_gap_s`: a burst is one
message) as a Redis PUBLISH, pushed to the peers at once. A message is a delta (the
assignments that started or ended since the last one) or, every `ttl_s / 3`, the full state
(every assignment it keeps), which also goes to a key with a TTL that a router starting later
reads first. Messages are numbered: a peer that misses one ignores that router's deltas until
its next full state, so a lost message costs at most one full-state period of staleness.
Alone, a router publishes only its full state (no one reads a delta: a publish and the
dispatch after it on every change were most of a lone router's Redis traffic), and the first
message after it hears of a new peer is its full state, whatever the newcomer read first. A
peer not heard from for `ttl_s` is gone (killed, or cut from Redis): its assignments are
forgotten, and the workers' heartbeats carry what remains of its work.

Staleness: a peer's assignment reaches this router within min_gap_s + a publish and its push
(a few ms on one network). Inside that window two routers may each place work on the same
worker. To bound that, a router that places a prompt on a prefill worker fences the worker
(WorkerView.fenced: the budget filter refuses it) until a publish that includes it has
reached Redis: each router has at most one request on a worker that the others have not been
told of, so a worker holds at most its prompt-token budget plus one request per router (when
every router takes in a peer's message before that peer's next publish completes: a loop not
stalled for milliseconds). Alone, or while Redis is unreachable, a router fences nothing.

Inside that window a peer may also place a short prompt on a worker that was just given a long
one, unaware of it, and the short prompt would then wait behind the long prefill. So a prompt
outside the short bucket is sent to its worker only once the peers have been told of it
(hold()): a short prompt a peer places there meanwhile reaches the worker first. The long
prompt waits min_gap_s + a publish, a few ms against its own prefill's hundreds.
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
from dataclasses import dataclass
from typing import Any

import redis
import redis.asyncio

from router import metrics
from router.ledger import Assignment
from router.redis_loops import raise_if_cancelled
from router.ticket import Ticket
from router.workers import WorkerPool

log = logging.getLogger(__name__)

KEY_PREFIX = "pdserve:routers"
CHANNEL = f"{KEY_PREFIX}:assignments"
SIDES = ("prefill", "decode")


def new_router_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


Record = list[Any]  # [serial, worker, amount, count, started_at, ended_at]


def record(a: Assignment) -> Record:
    return [a.serial, a.worker_id, a.amount, a.count, a.started_at, a.ended_at]


def encode(router_id: str, seq: int, full: bool, sides: dict[str, list[Assignment]]) -> str:
    message: dict[str, Any] = {"router_id": router_id, "seq": seq, "full": full}
    for side, assignments in sides.items():
        message[side] = [record(a) for a in assignments]
    return json.dumps(message, separators=(",", ":"))


@dataclass(frozen=True, slots=True)
class Message:
    peer: str
    seq: int
    full: bool
    sides: dict[str, list[Assignment]]


def decode(raw: str | bytes) -> Message:
    message = json.loads(raw)
    peer = str(message["router_id"])
    sides = {
        side: [
            Assignment(
                str(w),
                int(amount),
                float(start),
                None if end is None else float(end),
                int(count),
                owner=peer,
                serial=int(serial),
            )  # fmt: skip
            for serial, w, amount, count, start, end in message.get(side, [])
        ]
        for side in SIDES
    }
    return Message(peer, int(message["seq"]), bool(message["full"]), sides)


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
        self._peer_seq: dict[str, int | None] = {}  # None: waiting for its next full state
        self._seq = 0  # this router's next message number
        self._pending: dict[str, dict[int, Assignment]] = {side: {} for side in SIDES}
        self._published = True  # the last publish reached Redis
        # hold()'s waiters: (the number of the message that tells of their placement, future)
        self._held: list[tuple[int, asyncio.Future[None]]] = []
        self._changed = asyncio.Event()
        self._full_due = 0.0  # clock time of the next full state (0: at once)
        self._client: redis.asyncio.Redis | None = None  # run()'s; the simulator needs none

    def key(self) -> str:
        return f"{KEY_PREFIX}:{self.router_id}"

    def changed(self, side: str, assignment: Assignment) -> None:
        """This router's assignment started or ended: tell the peers (soon, batched)."""
        self._pending[side][assignment.serial] = assignment
        if self.heard_at:  # alone, no one reads a delta: the changes wait for the full state
            self._changed.set()

    def message(self, full: bool) -> tuple[str, set[str]]:
        """The next message to publish (the changes since the last one, or the full state),
        and the fenced workers whose work it tells of."""
        if full:
            sides = {side: self.pool.ledgers[side].own() for side in SIDES}
        else:
            sides = {side: list(pending.values()) for side, pending in self._pending.items()}
        for pending in self._pending.values():
            pending.clear()
        raw = encode(self.router_id, self._seq, full, sides)
        self._seq += 1
        return raw, set(self.pool.fenced)

    def published(self, told: set[str], reached: bool) -> None:
        """A publish of message() ended: it reached Redis, or not (then the peers cannot be
        told: no fence until they can, as they forget this router after ttl_s anyway, or it
        would place one request per worker per try; and they miss a number, so they wait for
        the next full state)."""
        self._published = reached
        self._release_held()
        self._fence_if_told()
        self.pool.unfence(told if reached else set(self.pool.fenced))
        self.on_peer_change()  # the unfenced workers may take queued work

    async def hold(self, ticket: Ticket) -> None:
        """Returns once a request placed just now may be sent to its worker: a prompt outside
        the short bucket waits until a publish that tells the peers of its placement has
        ended (reached Redis, or failed: then they cannot be told); a short prompt, or any
        prompt while this router has no peer to tell, goes at once."""
        if ticket.bucket == "short" or not self.pool.fencing:
            return
        held = asyncio.get_running_loop().create_future()
        self._held.append((self._seq, held))  # the next message() tells of it
        await held

    def _release_held(self) -> None:
        """After a publish of every message numbered below self._seq."""
        still = []
        for seq, held in self._held:
            if seq < self._seq:
                if not held.done():  # a cancelled waiter's future is done already
                    held.set_result(None)
            else:
                still.append((seq, held))
        self._held = still

    def take_in(self, raw: str | bytes) -> None:
        """A peer's message, as published."""
        try:
            message = decode(raw)
        except (ValueError, KeyError, TypeError) as e:
            log.warning("ignoring a malformed router message: %s", e)
            return
        peer = message.peer
        if peer == self.router_id:
            return
        if peer not in self.heard_at:  # it may have read an older full state of this router
            self._full_due = 0.0
            self._changed.set()
        self.heard_at[peer] = self.clock()
        last = self._peer_seq.get(peer)
        if message.full:
            for side in SIDES:
                self.pool.set_peer(side, peer, message.sides[side])
        elif last is not None and message.seq == last + 1:
            for side in SIDES:
                self.pool.update_peer(side, peer, message.sides[side])
        else:  # a message missed (or joined mid-stream): wait for the next full state
            if last is not None:
                log.info("missed a message from router %s: waiting for its full state", peer)
            self._peer_seq[peer] = None
            return
        self._peer_seq[peer] = message.seq
        self._peer_changed()

    async def run(self) -> None:
        """Publishes and listens until cancelled; then removes this router's key."""
        self._client = redis.asyncio.Redis.from_url(self.redis_url, socket_timeout=2.0)
        try:
            # A TaskGroup, not gather: cancelled, it waits for both loops to end, so nothing
            # is published after the key is deleted below.
            async with asyncio.TaskGroup() as loops:
                loops.create_task(self._publish_loop())
                loops.create_task(self._listen_loop())
        finally:
            with contextlib.suppress(redis.RedisError):  # if not, its TTL removes it
                await self._client.delete(self.key())
            await self._client.aclose()

    async def _publish_loop(self) -> None:
        while True:
            raise_if_cancelled()
            with contextlib.suppress(TimeoutError):  # idle: the full state, as a heartbeat
                async with asyncio.timeout(self.ttl_s / 3):
                    await self._changed.wait()
            self._changed.clear()
            full = self.clock() >= self._full_due
            if full:
                self._full_due = self.clock() + self.ttl_s / 3
            raw, told = self.message(full)
            assert self._client is not None
            try:
                async with self._client.pipeline(transaction=False) as pipe:
                    if full:
                        pipe.set(self.key(), raw, px=int(self.ttl_s * 1000))
                    pipe.publish(CHANNEL, raw)
                    await pipe.execute()
                self.published(told, reached=True)
            except redis.RedisError as e:  # the next full state tells the peers all again
                metrics.REPLICA_SYNC_FAILURES.labels("publish").inc()
                log.warning("publishing this router's assignments failed: %s", e)
                self.published(told, reached=False)
                self._full_due = 0.0
            await asyncio.sleep(self.min_gap_s)

    async def _listen_loop(self) -> None:
        while True:
            raise_if_cancelled()  # _listen() checks too, unless Redis is away before it can
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
                raise_if_cancelled()
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
            self._peer_seq.pop(peer, None)
            for side in SIDES:
                self.pool.set_peer(side, peer, [])
            self._peer_changed()

    def _peer_changed(self) -> None:
        self.pool.num_routers = len(self.heard_at) + 1
        metrics.ROUTER_REPLICAS.set(self.pool.num_routers)
        self._fence_if_told()
        self.on_peer_change()

    def _fence_if_told(self) -> None:
        """Fence prefill workers given work only while there are peers this router can tell;
        alone, or cut from Redis, nothing waits for a publish."""
        self.pool.fencing = bool(self.heard_at) and self._published
        if not self.pool.fencing:
            self.pool.unfence(set(self.pool.fenced))
