"""The host KV tier: full prefix blocks evicted from the pool, kept in host memory (or a file
on local disk) under their chained hash, least recently used first out, and copied back into
the pool when a prompt's prefix hits them."""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import time
import zlib
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from engine.block_pool import CacheEvent
from engine.errors import InvalidRequestError
from engine.kv_metrics import TIER_BLOCKS, TIER_BYTES, TIER_FAILED_LOADS, TIER_LOAD_SECONDS

log = logging.getLogger(__name__)


@dataclass(slots=True)
class TierStats:
    """What the tier did since it was made: the exact counts behind its metrics
    (engine/kv_metrics.py), for tests and benchmarks."""

    num_stored_blocks: int = 0
    num_loaded_blocks: int = 0
    num_failed_loads: int = 0
    num_evicted_blocks: int = 0  # dropped from the tier to make room (LRU)
    stored_bytes: int = 0
    loaded_bytes: int = 0
    load_s: float = 0.0


class SlotStore(Protocol):
    """Where the tier's blocks live: num_slots slots of block_bytes, each filled from a pool
    block and copied back into one (by pool block id). The tier itself only keeps which hash
    is in which slot; a store owns the bytes and their copies (the simulator's moves none and
    models their time: sim/worker.py)."""

    num_slots: int
    block_bytes: int

    def write(self, slot: int, block_id: int) -> bool: ...

    def read(self, slot: int, block_id: int) -> bool: ...


def num_slots_for(capacity_bytes: int, block_bytes: int) -> int:
    """The slots capacity_bytes holds; refused when not even one."""
    num_slots = capacity_bytes // block_bytes
    if num_slots == 0:
        raise InvalidRequestError(
            f"kv_offload_gb is {capacity_bytes / 2**30:.6g} GiB ({capacity_bytes} bytes), "
            f"less than one KV block ({block_bytes} bytes)"
        )
    return num_slots


class _MemorySlots:
    """Slots in host memory: a region of their own on the CPU; page-locked when the pool is on
    CUDA, so the copies are DMA. The copies are synchronous (no side stream yet): a store or a
    load waits for its block."""

    def __init__(self, pool_bytes: torch.Tensor, num_slots: int, pinned: bool) -> None:
        self.pool_bytes = pool_bytes
        self.num_slots, self.block_bytes = num_slots, pool_bytes.shape[1]
        # [num_slots, block_bytes] uint8: slot i holds one pool block's bytes as they were.
        self.data = torch.empty(num_slots, self.block_bytes, dtype=torch.uint8, pin_memory=pinned)

    def write(self, slot: int, block_id: int) -> bool:
        self.data[slot].copy_(self.pool_bytes[block_id])
        return True

    def read(self, slot: int, block_id: int) -> bool:
        self.pool_bytes[block_id].copy_(self.data[slot])
        return True


class _FileSlots:
    """Slots in a file on local disk, slot i at byte i * block_bytes. The file is scratch, not a
    cache that outlives the process: it is unlinked as soon as it is made, so a killed worker
    leaves nothing behind, and each slot's CRC32 is kept in memory, because the file can change
    under us (another process, a full disk, truncation): a slot whose bytes do not match, or
    that reads short, is refused before it reaches the pool."""

    def __init__(self, pool_bytes: torch.Tensor, directory: str, num_slots: int) -> None:
        self.pool_bytes = pool_bytes
        self.num_slots, self.block_bytes = num_slots, pool_bytes.shape[1]
        self.fd, path = tempfile.mkstemp(prefix="pdserve-kv-tier-", dir=directory)
        os.unlink(path)
        os.ftruncate(self.fd, num_slots * self.block_bytes)  # sparse: disk is used as slots fill
        self.crcs = [0] * num_slots
        self.staging = torch.empty(self.block_bytes, dtype=torch.uint8)  # a load lands here first

    def write(self, slot: int, block_id: int) -> bool:
        """False when the disk took less than the whole block (it is full)."""
        data = self.pool_bytes[block_id].cpu().numpy()  # a view on the CPU, a copy from CUDA
        self.crcs[slot] = zlib.crc32(data)
        try:
            return os.pwrite(self.fd, data, slot * self.block_bytes) == self.block_bytes
        except OSError:
            return False

    def read(self, slot: int, block_id: int) -> bool:
        staging = self.staging.numpy()
        num_read = os.preadv(self.fd, [staging], slot * self.block_bytes)
        if num_read != self.block_bytes or zlib.crc32(staging) != self.crcs[slot]:
            return False
        self.pool_bytes[block_id].copy_(self.staging)
        return True


def _check_room(capacity_bytes: int, path: str | None) -> None:
    """The tier fills as the pool evicts, so a size the host cannot hold would fail late (an
    OOM kill, a full disk) and far from its cause: it is refused at start-up instead."""
    if path is None:
        room, what = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), "host memory"
    else:
        room, what = shutil.disk_usage(path).free, f"free space in {path}"
    if capacity_bytes > room:
        raise InvalidRequestError(
            f"kv_offload_gb asks for {capacity_bytes / 2**30:.1f} GiB, more than the "
            f"{room / 2**30:.1f} GiB of {what}"
        )


class HostKVTier:
    """Blocks are stored whole, in the pool's own format (int8 KV with its scales included), in
    fixed slots; a hash maps to its slot in LRU order. The tier is inclusive: a block loaded
    back into the pool keeps its slot, so its next eviction from the pool costs no copy.

    Each load is timed on `clock` (the simulator's runs on its modelled copies), and the
    smoothed seconds a block takes (load_s_per_block) decide whether loading still beats
    computing (KVCacheManager) and what a hit in this tier is worth to the router."""

    def __init__(
        self, slots: SlotStore, where: str, clock: Callable[[], float] = time.perf_counter
    ) -> None:
        self.slots = slots
        self.num_slots, self.block_bytes = slots.num_slots, slots.block_bytes
        self.clock = clock
        self.hash_to_slot: OrderedDict[bytes, int] = OrderedDict()  # LRU order: oldest first
        self.free_slots = list(range(self.num_slots - 1, -1, -1))  # pop() gives slot 0 first
        self.stats = TierStats()
        self.load_s_per_block = 0.0  # 0: no load measured yet
        # Host-tier changes, (stored, hash), taken like the pool's (take_cache_events).
        self.record_events = False
        self._events: list[CacheEvent] = []
        self._publish_occupancy()
        log.info("host KV tier: %d blocks (%.2f GiB) in %s", self.num_slots,
                 self.capacity_bytes / 2**30, where)  # fmt: skip

    @property
    def capacity_bytes(self) -> int:
        return self.num_slots * self.block_bytes

    @property
    def num_used_slots(self) -> int:
        return len(self.hash_to_slot)

    def __contains__(self, block_hash: bytes) -> bool:
        return block_hash in self.hash_to_slot

    def store(self, block_id: int, block_hash: bytes) -> None:
        """Copies pool block block_id, cached under block_hash, into the tier (the pool is about
        to reuse it); a hash the tier holds already is only marked recently used."""
        if block_hash in self.hash_to_slot:
            self.hash_to_slot.move_to_end(block_hash)
            return
        slot = self.free_slots.pop() if self.free_slots else self._evict_oldest()
        if not self.slots.write(slot, block_id):
            self.free_slots.append(slot)  # not kept: a later prompt computes it
            self._publish_occupancy()
            return
        self.hash_to_slot[block_hash] = slot
        self._record(True, block_hash)
        self.stats.num_stored_blocks += 1
        self.stats.stored_bytes += self.block_bytes
        TIER_BYTES.labels("store").inc(self.block_bytes)
        self._publish_occupancy()

    def load(self, block_hash: bytes, block_id: int) -> bool:
        """Copies the block stored under block_hash into pool block block_id. False when the
        tier does not hold it, or holds it damaged (then it is dropped): the caller computes
        it instead, and block_id's bytes are unchanged."""
        slot = self.hash_to_slot.get(block_hash)
        if slot is None:
            return False
        started = self.clock()
        if not self.slots.read(slot, block_id):
            self.stats.num_failed_loads += 1
            TIER_FAILED_LOADS.inc()
            self._drop(block_hash)
            return False
        seconds = self.clock() - started
        # Smoothed like the engine's prefill speed: a disk that slows down is followed.
        previous = self.load_s_per_block
        self.load_s_per_block = seconds if previous == 0 else 0.8 * previous + 0.2 * seconds
        self.hash_to_slot.move_to_end(block_hash)
        self.stats.num_loaded_blocks += 1
        self.stats.loaded_bytes += self.block_bytes
        self.stats.load_s += seconds
        TIER_BYTES.labels("load").inc(self.block_bytes)
        TIER_LOAD_SECONDS.observe(seconds)
        return True

    def clear(self) -> int:
        """Forgets every block (e.g. after new weights); returns how many."""
        num_dropped = len(self.hash_to_slot)
        for block_hash in list(self.hash_to_slot):
            self._drop(block_hash)
        return num_dropped

    def take_events(self) -> list[CacheEvent]:
        """The tier's changes since the last call, oldest first."""
        events, self._events = self._events, []
        return events

    def _evict_oldest(self) -> int:
        block_hash, slot = self.hash_to_slot.popitem(last=False)
        self._record(False, block_hash)
        self.stats.num_evicted_blocks += 1
        return slot

    def _drop(self, block_hash: bytes) -> None:
        self.free_slots.append(self.hash_to_slot.pop(block_hash))
        self._record(False, block_hash)
        self._publish_occupancy()

    def _record(self, stored: bool, block_hash: bytes) -> None:
        if self.record_events:
            self._events.append((stored, block_hash))

    def _publish_occupancy(self) -> None:
        TIER_BLOCKS.labels("used").set(self.num_used_slots)
        TIER_BLOCKS.labels("capacity").set(self.num_slots)

    def check_integrity(self) -> None:
        """Raises with the numbers unless every slot is free or holds one hash, exactly once."""
        used, free = list(self.hash_to_slot.values()), self.free_slots
        problems = []
        if len(used) + len(free) != self.num_slots:
            problems.append(f"{len(used)} used + {len(free)} free != {self.num_slots} slots")
        if len(set(used) | set(free)) != len(used) + len(free):
            problems.append("a slot is listed twice")
        if any(not 0 <= s < self.num_slots for s in (*used, *free)):
            problems.append("a slot id is out of range")
        if problems:
            raise AssertionError("host KV tier corrupt: " + "; ".join(problems))


def host_tier(kv_cache: torch.Tensor, capacity_bytes: int, path: str | None) -> HostKVTier:
    """The engine's tier over its KV pool: slots in host memory, or in a file under path."""
    num_blocks = kv_cache.shape[0]
    assert kv_cache.is_contiguous(), "one block must be one byte range"
    # [num_blocks, block_bytes] uint8: a view of the pool, block i at row i.
    pool_bytes = kv_cache.view(num_blocks, -1).view(torch.uint8)
    block_bytes = pool_bytes.shape[1]
    num_slots = num_slots_for(capacity_bytes, block_bytes)
    _check_room(num_slots * block_bytes, path)
    if path is None:
        where = "host memory" + (" (pinned)" if kv_cache.is_cuda else "")
        return HostKVTier(_MemorySlots(pool_bytes, num_slots, pinned=kv_cache.is_cuda), where)
    return HostKVTier(_FileSlots(pool_bytes, path, num_slots), path)
