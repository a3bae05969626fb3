"""The block pool: owns every KV block id, its reference count and the prefix-cache map."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass


class NoFreeBlocksError(RuntimeError):
    def __init__(self, num_requested: int, num_free: int) -> None:
        super().__init__(f"asked for {num_requested} KV blocks, only {num_free} free")


# A prefix-cache change: (True, hash) when a block is cached under the hash, (False, hash) when
# it is evicted. Workers publish these so routers know what each worker's cache holds.
CacheEvent = tuple[bool, bytes]


@dataclass(slots=True)
class Block:
    block_id: int
    ref_cnt: int = 0
    block_hash: bytes | None = None  # set once the block is full and registered in the cache


class BlockPool:
    """Blocks are in use (ref_cnt > 0), cached-free (ref_cnt == 0 with a hash) or empty.

    Free blocks sit in two queues, both OrderedDicts for O(1) removal from the middle (a cache
    hit revives a cached-free block): allocation takes empty blocks first and only then evicts
    cached blocks, least recently freed first, so the prefix cache lives as long as it can.
    """

    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.empty: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.cached_free: OrderedDict[int, None] = OrderedDict()  # LRU order: oldest first
        self.hash_to_block: dict[bytes, int] = {}
        # Off unless someone takes the events (take_cache_events), or they would pile up.
        self.record_events = False
        self._events: list[CacheEvent] = []
        # Called with (block_id, hash) for each cached block that allocation evicts, while its
        # bytes are still whole: the KV cache manager sets it to copy them to the host tier.
        self.write_back: Callable[[int, bytes], None] | None = None

    @property
    def num_free_blocks(self) -> int:
        return len(self.empty) + len(self.cached_free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def usage(self) -> float:
        return self.num_used_blocks / self.num_blocks

    def allocate(self, num_blocks: int) -> list[int]:
        if num_blocks > self.num_free_blocks:
            raise NoFreeBlocksError(num_blocks, self.num_free_blocks)
        block_ids = []
        for _ in range(num_blocks):
            queue = self.empty if self.empty else self.cached_free
            block_id, _ = queue.popitem(last=False)
            block = self.blocks[block_id]
            if block.block_hash is not None:  # evicting a cached block
                if self.write_back is not None:
                    self.write_back(block_id, block.block_hash)
                self._forget(block)
            block.ref_cnt = 1
            block_ids.append(block_id)
        return block_ids

    def lookup(self, block_hash: bytes) -> int | None:
        return self.hash_to_block.get(block_hash) if self.enable_caching else None

    def touch(self, block_ids: Iterable[int]) -> None:
        """Takes a reference on cache hits, reviving cached-free blocks."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.ref_cnt == 0:
                del self.cached_free[block_id]
            block.ref_cnt += 1

    def free(self, block_ids: Iterable[int]) -> None:
        """Drops one reference each; pass a request's blocks tail first so the tail of a
        prefix is evicted before its head."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            assert block.ref_cnt > 0, f"double free of block {block_id}"
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                queue = self.cached_free if block.block_hash is not None else self.empty
                queue[block_id] = None

    def cache(self, block_id: int, block_hash: bytes) -> None:
        """Registers a full block under its hash; a hash already cached keeps its first block."""
        block = self.blocks[block_id]
        if not self.enable_caching or block.block_hash is not None:
            return
        if block_hash not in self.hash_to_block:
            self.hash_to_block[block_hash] = block_id
            block.block_hash = block_hash
            if self.record_events:
                self._events.append((True, block_hash))

    def reset_cache(self) -> int:
        """Forgets every cached-free block (e.g. after new weights); returns how many."""
        num_evicted = len(self.cached_free)
        for block_id in list(self.cached_free):
            self._forget(self.blocks[block_id])
            del self.cached_free[block_id]
            self.empty[block_id] = None
        return num_evicted

    def take_cache_events(self) -> list[CacheEvent]:
        """The prefix-cache changes since the last call, oldest first."""
        events, self._events = self._events, []
        return events

    def _forget(self, block: Block) -> None:
        assert block.block_hash is not None
        del self.hash_to_block[block.block_hash]
        if self.record_events:
            self._events.append((False, block.block_hash))
        block.block_hash = None

    def check_integrity(self) -> None:
        """Raises with the numbers when the pool's bookkeeping disagrees with itself."""
        num_in_use = sum(1 for b in self.blocks if b.ref_cnt > 0)
        free_ids = set(self.empty) | set(self.cached_free)
        problems = []
        if num_in_use + len(free_ids) != self.num_blocks:
            problems.append(
                f"{num_in_use} in use + {len(free_ids)} free != {self.num_blocks} blocks"
            )
        if len(free_ids) != len(self.empty) + len(self.cached_free):
            problems.append("a block sits in both free queues")
        if any(self.blocks[i].ref_cnt != 0 for i in free_ids):
            problems.append("a free block has a reference")
        if any(self.blocks[i].block_hash is not None for i in self.empty):
            problems.append("an empty block still has a hash")
        stale = [h for h, i in self.hash_to_block.items() if self.blocks[i].block_hash != h]
        if stale:
            problems.append(f"{len(stale)} cache entries point at blocks with another hash")
        if problems:
            raise AssertionError("block pool corrupt: " + "; ".join(problems))
