"""What each worker's prefix cache holds, followed from the workers' event streams
(pdserve/kv_events.py): how many leading tokens of a prompt a worker has cached (what the
prefix scorers weigh), and the overlap of each routing choice (for /admin/workers). A worker's
cache is its KV pool and its host tier; a block held in the host tier counts less than one in
the pool, by what loading it costs."""

from __future__ import annotations

import asyncio
import logging
import math
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

import redis
import redis.asyncio

from pdserve.kv_events import STREAM_PREFIX, CacheUpdate, stream_key
from pdserve.registry import WorkerInfo
from router import metrics
from router.redis_loops import raise_if_cancelled
from router.ticket import Ticket

log = logging.getLogger(__name__)

_RECENT_CHOICES = 32
# Applied for every stream entry of every worker: the labelled counters looked up once.
_STORED, _EVICTED = metrics.KV_EVENTS.labels("stored"), metrics.KV_EVENTS.labels("evicted")
# What the prefill scorer credits a token a prefill worker would read from the decode worker,
# against one in its own cache: it saves its compute but costs its transfer (~2% of the
# compute on this CPU: 46 KB at ~2 GB/s against ~2 ms; more on a GPU). A little below 1, a
# worker holding the prefix still wins at equal load, and load alone decides between workers
# that would all read it.
FETCHED_TOKEN_WORTH = 0.9
# What a prompt token in a worker's host tier (not its pool) is worth against one in its pool
# until the worker has measured both its tier's loads and its prefill: the worker copies it
# back before the prefill instead of computing it, and it takes a free pool block first. Once
# measured, the worth is the part of computing it that loading saves (host_token_worth).
HOST_TOKEN_WORTH = 0.95


def host_token_worth(worker: WorkerInfo) -> float:
    """A host-tier token against a pool token: 1 - (seconds to load it) / (seconds to compute
    it), from the worker's own measurements; HOST_TOKEN_WORTH until it has both. At or below 0,
    loading is slower than computing and the worker computes the block (KVCacheManager)."""
    load = worker.load
    if load.host_load_s_per_token > 0 and load.prefill_tokens_per_s > 0:
        return 1 - load.host_load_s_per_token * load.prefill_tokens_per_s
    return HOST_TOKEN_WORTH


@dataclass(frozen=True, slots=True)
class Choice:
    request_id: str
    prefill_worker: str
    prefill_overlap_tokens: int  # prompt tokens its prefix cache holds: prefill not computed
    decode_worker: str
    decode_overlap_tokens: int  # prompt tokens of KV it holds: not sent, not allocated


@dataclass(slots=True)
class _WorkerBits:
    """A bit per worker the index follows, so the workers holding a block are one int. There
    is an entry per block cached anywhere in the fleet (millions at 1,024 workers), made as
    the block is first cached: as a set each was a container the garbage collector counts and
    tracks, and the collections it set off inside the index's updates cost more the larger
    the fleet. An int is neither. A forgotten worker's bit goes to the next new one (the
    lowest free first), so the masks stay as long as the fleet is large."""

    _bits: dict[str, int] = field(default_factory=dict)  # worker id -> its bit, 1 << n
    _ids: list[str | None] = field(default_factory=list)  # worker id by n; None: free

    def bit(self, worker_id: str) -> int:
        """The worker's bit, given it on first use."""
        bit = self._bits.get(worker_id)
        if bit is None:
            n = next((n for n, held in enumerate(self._ids) if held is None), len(self._ids))
            if n == len(self._ids):
                self._ids.append(None)
            self._ids[n] = worker_id
            bit = self._bits[worker_id] = 1 << n
        return bit

    def free(self, worker_id: str) -> None:
        """Once no mask holds the worker's bit any more."""
        bit = self._bits.pop(worker_id, None)
        if bit is not None:
            self._ids[bit.bit_length() - 1] = None

    def worker_ids(self, mask: int) -> set[str]:
        ids: set[str] = set()
        while mask:
            lowest = mask & -mask
            ids.add(self._ids[lowest.bit_length() - 1])  # type: ignore[arg-type]  # never free
            mask ^= lowest
        return ids


@dataclass(slots=True)
class _TierIndex:
    """One tier across the workers: per worker the block hashes it holds, and per block hash
    the workers holding it (their bits OR-ed, _WorkerBits)."""

    cached: dict[str, set[bytes]] = field(default_factory=dict)
    holders: dict[bytes, int] = field(default_factory=dict)

    def apply(
        self, worker_id: str, bit: int, is_snapshot: bool, stored: tuple[bytes, ...],
        evicted: tuple[bytes, ...],
    ) -> None:  # fmt: skip
        cached = self.cached.get(worker_id)
        if cached is None:
            cached = self.cached[worker_id] = set()
        self.forget(worker_id, bit, cached.difference(stored) if is_snapshot else evicted)
        cached.update(stored)
        holders = self.holders
        for block_hash in stored:
            holders[block_hash] = holders.get(block_hash, 0) | bit

    def forget(self, worker_id: str, bit: int, block_hashes: Iterable[bytes]) -> None:
        cached = self.cached.get(worker_id, set())
        holders = self.holders
        for block_hash in block_hashes:
            cached.discard(block_hash)
            held = holders.get(block_hash)
            if held is not None:
                if held := held & ~bit:
                    holders[block_hash] = held
                else:
                    del holders[block_hash]

    def drop(self, worker_id: str, bit: int) -> None:
        self.forget(worker_id, bit, self.cached.pop(worker_id, set()))


@dataclass(slots=True)
class PrefixIndex:
    """The pool and the host tier of every worker (so the workers a prompt's prefix is cached
    on are found without asking each one). A ticket's prompt is hashed at the workers' block
    size (WorkerPool.block_size); a worker registered with another one never matches."""

    pool: _TierIndex = field(default_factory=_TierIndex)
    host: _TierIndex = field(default_factory=_TierIndex)
    _bits: _WorkerBits = field(default_factory=_WorkerBits)
    _positions: dict[str, str] = field(default_factory=dict)  # last stream entry id read
    _seqs: dict[str, int] = field(default_factory=dict)  # last entry number applied
    _last_overlap: dict[str, int] = field(default_factory=dict)
    recent: deque[Choice] = field(default_factory=lambda: deque(maxlen=_RECENT_CHOICES))

    def apply(self, worker_id: str, entry_id: str, update: CacheUpdate) -> bool:
        """Applies one stream entry; False when entries before it were missed: the worker is
        then forgotten, to be read again from the start of its stream (not from this entry
        or the ones after it)."""
        last = self._seqs.get(worker_id)
        missed = update.seq is not None and last is not None and update.seq != last + 1
        if missed and not update.is_snapshot:  # a snapshot replaces all before it anyway
            # Entries were missed (trimmed unread, or lost with a Redis restart): this copy
            # may be wrong, so the worker's stream is read again from its start.
            log.warning("prefix-cache events of %s jumped from %d to %d: reading them afresh",
                        worker_id, last, update.seq)  # fmt: skip
            metrics.KV_EVENT_RESYNCS.inc()
            self._reset(worker_id)
            return False
        if update.seq is not None:
            self._seqs[worker_id] = update.seq
        bit = self._bits.bit(worker_id)
        self.pool.apply(worker_id, bit, update.is_snapshot, update.stored, update.evicted)
        self.host.apply(worker_id, bit, update.is_snapshot, update.host_stored,
                        update.host_evicted)  # fmt: skip
        self._positions[worker_id] = entry_id
        _STORED.inc(len(update.stored) + len(update.host_stored))
        _EVICTED.inc(len(update.evicted) + len(update.host_evicted))
        return True

    def retain(self, worker_ids: set[str]) -> None:
        """Forgets the workers that left the registry (one that returns is read afresh)."""
        for worker_id in set(self._positions) - worker_ids:
            self._reset(worker_id)

    def _reset(self, worker_id: str) -> None:
        self._positions.pop(worker_id, None)
        self._seqs.pop(worker_id, None)
        bit = self._bits.bit(worker_id)
        self.pool.drop(worker_id, bit)
        self.host.drop(worker_id, bit)
        self._bits.free(worker_id)
        self._last_overlap.pop(worker_id, None)

    def position(self, worker_id: str) -> str:
        return self._positions.get(worker_id, "0-0")  # a new worker: its whole stream

    def cached_hashes(self, worker_id: str) -> frozenset[bytes]:
        return frozenset(self.pool.cached.get(worker_id, ()))

    def host_cached_hashes(self, worker_id: str) -> frozenset[bytes]:
        return frozenset(self.host.cached.get(worker_id, ()))

    def holders(self, ticket: Ticket) -> set[str]:
        """The workers whose cache (either tier) holds the prompt's first block: the only ones
        with an overlap (at any block size)."""
        if not ticket.block_hashes:
            return set()
        first = ticket.block_hashes[0]
        return self._bits.worker_ids(
            self.pool.holders.get(first, 0) | self.host.holders.get(first, 0)
        )

    def overlap_tokens(self, worker: WorkerInfo, ticket: Ticket) -> int:
        """The leading prompt tokens the worker's cache holds, a token in its host tier only
        counted host_token_worth of one in its pool. The router counts whole tokens: the host
        tier's share is rounded down, and kept a token below the pool's, so a tier hit always
        scores below the same hit in the pool. Where loading measured slower than computing, the
        worker computes from its first host-tier block on, and so the count stops there."""
        if worker.block_size != ticket.block_size:
            return 0
        pool = self.pool.cached.get(worker.worker_id, set())
        host = self.host.cached.get(worker.worker_id, set())
        worth = host_token_worth(worker) if host else 0.0
        num_pool = num_host = 0
        for block_hash in ticket.block_hashes:
            if block_hash in pool:
                num_pool += 1
            elif block_hash in host and worth > 0:
                num_host += 1
            else:
                break
        host_tokens = num_host * ticket.block_size
        if host_tokens:  # rounded down, and a token below the pool's at the least
            host_tokens = min(math.floor(host_tokens * worth), host_tokens - 1)
        return num_pool * ticket.block_size + host_tokens

    def prefill_prefix(self, worker: WorkerInfo, ticket: Ticket) -> tuple[int, int]:
        """Prompt tokens a prefill worker need not compute: (its own cached prefix, the part
        past it it would read from the chosen decode worker, when it fetches)."""
        own = self.overlap_tokens(worker, ticket)
        fetched = max(0, ticket.held_prefix_tokens - own) if worker.peer_fetch else 0
        return own, fetched

    def record(self, ticket: Ticket, prefill: WorkerInfo, decode: WorkerInfo) -> Choice:
        """A routing choice: its overlaps go to the metric and the admin view."""
        prefill_tokens = self.overlap_tokens(prefill, ticket)
        decode_tokens = prefill_tokens if decode is prefill else self.overlap_tokens(decode, ticket)
        choice = Choice(
            ticket.request_id, prefill.worker_id, prefill_tokens, decode.worker_id, decode_tokens
        )
        sides = [(prefill, choice.prefill_overlap_tokens)]
        if decode is not prefill:  # an aggregated worker is one choice
            sides.append((decode, choice.decode_overlap_tokens))
        for worker, tokens in sides:
            metrics.child(metrics.PREFIX_OVERLAP, worker.role).observe(tokens)
            self._last_overlap[worker.worker_id] = tokens
        self.recent.append(choice)
        return choice

    def worker_json(self, worker_id: str) -> dict[str, int | None]:
        return {
            "cached_blocks": len(self.pool.cached.get(worker_id, ())),
            "host_cached_blocks": len(self.host.cached.get(worker_id, ())),
            "last_overlap_tokens": self._last_overlap.get(worker_id),
        }

    def recent_json(self) -> list[dict[str, Any]]:
        return [asdict(c) for c in self.recent]


async def follow(
    index: PrefixIndex, redis_url: str, worker_ids: Callable[[], Iterable[str]],
    block_ms: int = 200,
) -> None:  # fmt: skip
    """Reads the registered workers' streams into the index until cancelled: a worker new to
    the index from its first entry (its last snapshot rebuilds it), then as entries come."""
    client = redis.asyncio.Redis.from_url(redis_url, socket_timeout=5.0)
    try:
        while True:
            raise_if_cancelled()  # or the router's shutdown could wait on this task forever
            registered = set(worker_ids())
            index.retain(registered)
            if not registered:
                await asyncio.sleep(block_ms / 1000)
                continue
            streams = {stream_key(w): index.position(w) for w in sorted(registered)}
            try:
                replies = await client.xread(streams, count=1000, block=block_ms)
            except redis.RedisError as e:  # keep routing on what the index holds
                log.warning("reading prefix-cache events failed: %s", e)
                await asyncio.sleep(1.0)
                continue
            for key, entries in replies:
                worker_id = key.decode()[len(STREAM_PREFIX) + 1 :]
                if worker_id not in registered:
                    continue
                for entry_id, fields in entries:
                    if not index.apply(
                        worker_id, entry_id.decode(), CacheUpdate.from_fields(fields)
                    ):
                        break
    finally:
        await client.aclose()
