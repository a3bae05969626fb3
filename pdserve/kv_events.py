"""Prefix-cache events in Redis: each worker publishes which block hashes its prefix cache
gained and lost to a bounded stream of its own; routers read the streams to know what every
worker has cached (router/prefix_index.py). The KV pool's changes and its host tier's
(engine/kv_tier.py) travel side by side, each tier's hashes in fields of its own.

An entry is a delta (hashes stored, hashes evicted, since the previous entry) or a snapshot
(every hash cached now, in each tier; it replaces what came before). A worker writes a
snapshot first and then after every SNAPSHOT_EVERY deltas, so the last MAX_ENTRIES entries,
all the stream keeps, always rebuild the whole cache.

Entries are numbered (`seq`, one more per entry, snapshots included), so a reader that finds a
number missing (entries trimmed before it read them, or lost with a Redis restart) knows its
copy is wrong and reads the stream afresh. A worker that finds its stream gone (Redis
restarted) writes a snapshot next, so a new stream always starts with one.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace

import redis

from engine.prefix_hash import HASH_BYTES

log = logging.getLogger(__name__)

STREAM_PREFIX = "pdserve:kv_events"
MAX_ENTRIES = 1024  # XADD MAXLEN ~: Redis keeps at least this many, trimming whole nodes
SNAPSHOT_EVERY = MAX_ENTRIES // 4
# A stream outlives its worker by at most this long (a killed worker cannot delete it).
STREAM_TTL_S = 120.0
# A busy worker writes at most one entry per this long (its changes in between batched).
BATCH_S = 0.05


def stream_key(worker_id: str) -> str:
    return f"{STREAM_PREFIX}:{worker_id}"


# A change to one tier, as the engine reports it (engine/block_pool.py, engine/kv_tier.py):
# (True, hash) stored, (False, hash) evicted.
CacheEvent = tuple[bool, bytes]


@dataclass(frozen=True, slots=True)
class CacheUpdate:
    """One stream entry, decoded. A block the pool evicts into the host tier is one hash in
    `evicted` and the same in `host_stored`."""

    is_snapshot: bool
    stored: tuple[bytes, ...]
    evicted: tuple[bytes, ...] = ()
    host_stored: tuple[bytes, ...] = ()
    host_evicted: tuple[bytes, ...] = ()
    seq: int | None = None  # None: unnumbered (read only, from an older worker)

    def fields(self) -> dict[str, bytes]:
        fields = {
            "kind": b"snapshot" if self.is_snapshot else b"delta",
            "stored": b"".join(self.stored),
            "evicted": b"".join(self.evicted),
            "host_stored": b"".join(self.host_stored),
            "host_evicted": b"".join(self.host_evicted),
        }
        return fields if self.seq is None else fields | {"seq": str(self.seq).encode()}

    @classmethod
    def from_fields(cls, fields: dict[bytes, bytes]) -> CacheUpdate:
        # A worker without a host tier, or from before there was one, writes no host fields.
        seq = fields.get(b"seq")
        return cls(
            fields.get(b"kind") == b"snapshot",
            *(_split(fields.get(name, b"")) for name in _HASH_FIELDS),
            seq=None if seq is None else int(seq),
        )

    @property
    def num_events(self) -> int:
        return sum(map(len, (self.stored, self.evicted, self.host_stored, self.host_evicted)))


_HASH_FIELDS = (b"stored", b"evicted", b"host_stored", b"host_evicted")


def _split(joined: bytes) -> tuple[bytes, ...]:
    return tuple(joined[i : i + HASH_BYTES] for i in range(0, len(joined), HASH_BYTES))


@dataclass(slots=True)
class TierMirror:
    """One tier as events report it, and what the stream has been told: a delta holds only
    the difference, so a hash stored and evicted between two entries costs nothing, and a
    failed write is simply retried with the next one (the pending set is bounded by the
    tier's own size)."""

    cached: set[bytes] = field(default_factory=set)
    published: set[bytes] = field(default_factory=set)
    dirty: set[bytes] = field(default_factory=set)  # may differ between the two

    def apply(self, events: Iterable[CacheEvent]) -> None:
        for stored, block_hash in events:
            if stored:
                self.cached.add(block_hash)
            else:
                self.cached.discard(block_hash)
            self.dirty.add(block_hash)

    def delta(self) -> tuple[tuple[bytes, ...], tuple[bytes, ...]]:
        """(stored, evicted) since the last publication."""
        stored = tuple(h for h in self.dirty if h in self.cached and h not in self.published)
        evicted = tuple(h for h in self.dirty if h in self.published and h not in self.cached)
        return stored, evicted

    def mark_published(
        self, is_snapshot: bool, stored: tuple[bytes, ...], evicted: tuple[bytes, ...]
    ) -> None:
        if is_snapshot:
            self.published = set(self.cached)
        else:
            self.published.difference_update(evicted)
            self.published.update(stored)
        self.dirty.clear()


@dataclass(slots=True)
class CacheMirror:
    """The worker's KV pool and host tier, each followed by its own TierMirror."""

    pool: TierMirror = field(default_factory=TierMirror)
    host: TierMirror = field(default_factory=TierMirror)

    def apply(self, events: Iterable[CacheEvent], host_events: Iterable[CacheEvent] = ()) -> None:
        self.pool.apply(events)
        self.host.apply(host_events)

    def delta(self) -> CacheUpdate:
        return CacheUpdate(False, *self.pool.delta(), *self.host.delta())

    def snapshot(self) -> CacheUpdate:
        return CacheUpdate(True, tuple(self.pool.cached), host_stored=tuple(self.host.cached))

    def mark_published(self, update: CacheUpdate) -> None:
        self.pool.mark_published(update.is_snapshot, update.stored, update.evicted)
        self.host.mark_published(update.is_snapshot, update.host_stored, update.host_evicted)


@dataclass(slots=True)
class CacheStream:
    """A worker's stream as the entries it is told, whatever carries them (the publisher writes
    them to Redis; the simulator hands them to its routers): the mirror, each entry's number,
    and when the next entry must be a snapshot."""

    mirror: CacheMirror = field(default_factory=CacheMirror)
    seq: int = 0  # the next entry's number
    num_entries: int = 0  # written since the last snapshot

    @property
    def snapshot_due(self) -> bool:
        return self.num_entries >= SNAPSHOT_EVERY

    def next_entry(self, snapshot: bool) -> CacheUpdate | None:
        """The next entry, numbered; None when nothing changed since the last one. Hand it
        to written() once it is stored."""
        update = self.mirror.snapshot() if snapshot else self.mirror.delta()
        if not snapshot and not update.num_events:
            self.mirror.mark_published(update)  # hashes that came and went: nothing to tell
            return None
        update = replace(update, seq=self.seq)
        self.seq += 1  # a failed write leaves a gap: readers then read the stream afresh
        return update

    def written(self, update: CacheUpdate) -> None:
        self.num_entries = 0 if update.is_snapshot else self.num_entries + 1
        self.mirror.mark_published(update)


Changes = tuple[Sequence[CacheEvent], Sequence[CacheEvent]]


class CacheEventPublisher:
    """A worker's publisher thread: the engine thread hands it each loop turn's events
    (submit never blocks), and it writes at most one entry per wake-up to the worker's stream,
    so Redis latency or an outage never reaches a step."""

    def __init__(
        self, client: redis.Redis, worker_id: str, idle_s: float = 2.0, batch_s: float = BATCH_S
    ) -> None:
        self.client = client
        self.key = stream_key(worker_id)
        self.idle_s = idle_s  # how often an idle worker refreshes its stream's TTL
        self.batch_s = batch_s
        self.stream = CacheStream()
        # Each item: one loop turn's (pool events, host-tier events); None ends the thread.
        self._inbox: queue.SimpleQueue[Changes | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)

    def start(self) -> CacheEventPublisher:
        # A worker restarted under the same id starts with an empty cache: say so first.
        snapshot = self.stream.next_entry(snapshot=True)
        assert snapshot is not None
        with self.client.pipeline() as pipe:
            pipe.delete(self.key)
            self._add(pipe, snapshot)
            pipe.expire(self.key, int(STREAM_TTL_S))
            pipe.execute()
        self.stream.written(snapshot)
        self._thread.start()
        return self

    def submit(self, events: Sequence[CacheEvent], host_events: Sequence[CacheEvent] = ()) -> None:
        self._inbox.put((events, host_events))

    def stop(self) -> None:
        """Stops publishing and deletes the stream (the worker is leaving)."""
        if self._thread.is_alive():
            self._inbox.put(None)
            self._thread.join(timeout=5)
        try:
            self.client.delete(self.key)
        except redis.RedisError as e:  # the TTL cleans up
            log.warning("could not delete %s: %s", self.key, e)

    def _run(self) -> None:
        while True:
            try:
                batch = self._inbox.get(timeout=self.idle_s)
            except queue.Empty:
                batch = ([], [])
            while batch is not None:
                self.stream.mirror.apply(*batch)
                try:
                    batch = self._inbox.get_nowait()
                except queue.Empty:
                    break
            if batch is None:
                return
            try:
                self._publish()
            except redis.RedisError as e:  # the dirty hashes go out with the next entry
                log.warning("publishing prefix-cache events failed: %s", e)
            time.sleep(self.batch_s)

    def _publish(self) -> None:
        stream = self.stream
        # A stream gone with a restarted Redis starts again from a snapshot.
        update = stream.next_entry(stream.snapshot_due or not self.client.exists(self.key))
        with self.client.pipeline(transaction=False) as pipe:
            if update is not None:
                self._add(pipe, update)
            pipe.expire(self.key, int(STREAM_TTL_S))
            pipe.execute()
        if update is not None:
            stream.written(update)

    def _add(self, pipe: redis.client.Pipeline, update: CacheUpdate) -> None:
        pipe.xadd(self.key, update.fields(), maxlen=MAX_ENTRIES, approximate=True)
