"""Per-request KV block tables on top of the block pool (and its host tier, when there is one):
prefix hits, slot allocation, freeing. Every change to a block's references goes through here;
the pool only counts them."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from engine.block_pool import BlockPool
from engine.errors import InsufficientKVError
from engine.kv_metrics import TIER_LOOKUPS
from engine.prefix_hash import extend_block_hashes, prompt_block_hashes
from engine.request import Request

if TYPE_CHECKING:
    from engine.kv_tier import HostKVTier  # torch: built by the engine, only called here


@dataclass(slots=True)
class PrefixCacheStats:
    num_queried_tokens: int = 0
    num_hit_tokens: int = 0  # from either tier
    num_host_hit_tokens: int = 0  # of those, loaded from the host tier
    # Held by the host tier but computed: loading them measured slower than computing them.
    num_host_skipped_tokens: int = 0

    @property
    def hit_rate(self) -> float:
        return self.num_hit_tokens / self.num_queried_tokens if self.num_queried_tokens else 0.0


class KVCacheManager:
    def __init__(self, pool: BlockPool, block_size: int, tier: HostKVTier | None = None) -> None:
        self.pool = pool
        self.block_size = block_size
        self.tier = tier
        if tier is not None:
            pool.write_back = tier.store  # write-back on eviction: every full cached block
        self.stats = PrefixCacheStats()
        # The engine's measured prefill seconds a token (0: not measured yet): a tier block is
        # loaded only while its measured load takes less than computing its tokens would.
        self.prefill_s_per_token = 0.0
        # In use, but by no request: a remote writer may still be writing into them (its fence
        # timed out), so they must not be handed out until it is known done or dead.
        self.quarantined: set[int] = set()

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def match_prefix(self, request: Request) -> int:
        """Claims the cached full blocks that start this request's tokens; returns the number of
        tokens they hold."""
        assert not request.block_ids, "prefix matching is for a request without blocks"
        counted, request.prefix_looked_up = request.prefix_looked_up, False
        request.block_ids = self._claim(self._hittable_hashes(request), count=not counted)
        request.num_registered_blocks = len(request.block_ids)
        num_hit_tokens = len(request.block_ids) * self.block_size
        self.stats.num_queried_tokens += request.num_tokens
        self.stats.num_hit_tokens += num_hit_tokens
        return num_hit_tokens

    def claim_prefix(self, prompt_token_ids: list[int]) -> list[int]:
        """The blocks a prefix match of this prompt would hit, a reference taken on each (the
        host tier's loaded back into the pool, as a match loads them); release drops them.
        The walk counts in the lookup metrics as the request's own match would: the request
        then says so (Request.prefix_looked_up)."""
        return self._claim(prompt_block_hashes(prompt_token_ids, self.block_size), count=True)

    def _claim(self, block_hashes: Sequence[bytes], count: bool) -> list[int]:
        """The leading blocks cached in the pool or, past it, the host tier, referenced; each
        lookup counted in the tiers' metrics when `count`."""
        hit_ids: list[int] = []
        for block_hash in block_hashes:
            block_id = self.pool.lookup(block_hash)
            self._count(count, "pool", "miss" if block_id is None else "hit")
            if block_id is not None:
                self.pool.touch([block_id])  # at once: loads below must not evict it
            elif (block_id := self._load_from_tier(block_hash, count)) is None:
                break
            hit_ids.append(block_id)
        return hit_ids

    def _load_from_tier(self, block_hash: bytes, count: bool) -> int | None:
        """A fresh pool block holding the host tier's copy of block_hash, cached under it and
        referenced once; None when there is no tier, it lacks the block, loading a block has
        measured slower than computing its tokens, the load fails, or the pool has no free
        block (the block is computed instead)."""
        tier = self.tier
        if tier is None:
            return None
        if block_hash not in tier or not self.pool.num_free_blocks:
            self._count(count, "host", "miss")
            return None
        if tier.load_s_per_block > self.block_size * self.prefill_s_per_token > 0:
            self._count(count, "host", "skipped")
            return None
        # Allocating may evict a cached block into the tier, and that may push this very block
        # out of a full tier: load() then says it is gone.
        [block_id] = self.pool.allocate(1)
        if not tier.load(block_hash, block_id):
            self._count(count, "host", "miss")
            self.pool.free([block_id])
            return None
        self._count(count, "host", "hit")
        self.pool.cache(block_id, block_hash)
        return block_id

    def _count(self, count: bool, tier: str, result: str) -> None:
        """A block looked up in a tier: hit, miss or (host tier) skipped, when `count`."""
        if not count:
            return
        TIER_LOOKUPS.labels(tier, result).inc()
        if tier == "host" and result == "hit":
            self.stats.num_host_hit_tokens += self.block_size
        elif tier == "host" and result == "skipped":
            self.stats.num_host_skipped_tokens += self.block_size

    def cache_prompt_blocks(
        self, prompt_token_ids: list[int], first_block: int, block_ids: list[int]
    ) -> None:
        """Registers blocks holding the prompt's blocks from first_block on (filled by a peer)."""
        hashes = prompt_block_hashes(prompt_token_ids, self.block_size)[first_block:]
        assert len(block_ids) <= len(hashes), "only full blocks before the last token are cached"
        for block_id, block_hash in zip(block_ids, hashes, strict=False):
            self.pool.cache(block_id, block_hash)

    def num_new_blocks_needed(self, request: Request, num_new_tokens: int) -> int:
        needed = self.num_blocks_for(request.num_computed_tokens + num_new_tokens)
        return max(0, needed - len(request.block_ids))

    def allocate_slots(self, request: Request, num_new_tokens: int) -> bool:
        """Makes room for num_new_tokens more KV entries; False (and nothing taken) if the
        pool cannot."""
        num_new_blocks = self.num_new_blocks_needed(request, num_new_tokens)
        if num_new_blocks > self.pool.num_free_blocks:
            return False
        request.block_ids.extend(self.pool.allocate(num_new_blocks))
        return True

    def cache_computed_blocks(self, request: Request) -> None:
        """Registers the request's full, computed blocks in the prefix cache: those filled
        since the last call (a full block whose hash another block holds stays unregistered)."""
        self._hash_full_blocks(request)
        num_full = request.num_computed_tokens // self.block_size
        first = request.num_registered_blocks
        for block_id, block_hash in zip(
            request.block_ids[first:num_full], request.block_hashes[first:num_full], strict=False
        ):
            self.pool.cache(block_id, block_hash)
        request.num_registered_blocks = max(first, num_full)

    def free(self, request: Request) -> None:
        self.pool.free(reversed(request.block_ids))
        request.block_ids = []
        request.num_registered_blocks = 0

    def reset_cache(self) -> int:
        """Forgets every cached block not in use, in the pool and the host tier (e.g. after
        warm-up or new weights); returns how many."""
        num_dropped = self.pool.reset_cache()
        return num_dropped + (self.tier.clear() if self.tier is not None else 0)

    def blocks_in_flight(self, request: Request) -> list[bytes]:
        """The hashes of the prompt blocks this running request has still to fill (this step or
        later) and register; none with prefix caching off."""
        if not self.pool.enable_caching:
            return []
        self._hash_full_blocks(request)
        num_prompt_blocks = request.num_prompt_tokens // self.block_size
        return request.block_hashes[request.num_registered_blocks : num_prompt_blocks]

    def peek_prefix(self, request: Request) -> int:
        """The tokens a prefix match of this waiting request would find now, in the pool or the
        host tier, without claiming or counting them (the match may still find fewer: a tier
        load can fail, or measure slower than computing)."""
        hittable = self._hittable_hashes(request)
        missed = self._first_missed(hittable, with_tier=True)
        return (len(hittable) if missed is None else missed) * self.block_size

    def first_missed_block(self, request: Request) -> bytes | None:
        """The hash of the first block a prefix match of this waiting request would not find in
        the pool; None when every block it may hit is there."""
        hittable = self._hittable_hashes(request)
        missed = self._first_missed(hittable, with_tier=False)
        return None if missed is None else hittable[missed]

    def _first_missed(self, block_hashes: list[bytes], with_tier: bool) -> int | None:
        """The index of the first block neither the pool nor (with_tier) the host tier holds."""
        tier = self.tier if with_tier else None
        for index, block_hash in enumerate(block_hashes):
            if self.pool.lookup(block_hash) is None and (tier is None or block_hash not in tier):
                return index
        return None

    def _hittable_hashes(self, request: Request) -> list[bytes]:
        """The hashes of the request's blocks a prefix match may hit: its full blocks before
        the last token, which is never a hit (its logits are needed)."""
        self._hash_full_blocks(request)
        return request.block_hashes[: (request.num_tokens - 1) // self.block_size]

    def _hash_full_blocks(self, request: Request) -> None:
        extend_block_hashes(request.block_hashes, request.token_ids, self.block_size)

    # ---- references held outside a request's block table -----------------------------------
    def hold(self, block_ids: Iterable[int]) -> None:
        """Takes a reference on each block, so it outlives the request that uses it (bytes
        still leaving for a peer); release drops it."""
        self.pool.touch(block_ids)

    def release(self, block_ids: Iterable[int]) -> None:
        """Drops one reference each, taken by hold, claim_prefix or reserve_prefix_fetch."""
        self.pool.free(block_ids)

    def reserve_prefix_fetch(self, num_blocks: int, max_used_blocks: int) -> list[int] | None:
        """Allocates num_blocks for the blocks a peer holds past our claimed prefix
        (claim_prefix); None when that would leave more than max_used_blocks in use."""
        if (
            num_blocks > self.pool.num_free_blocks
            or self.pool.num_used_blocks + num_blocks > max_used_blocks
        ):
            return None
        return self.pool.allocate(num_blocks)

    # ---- quarantine: blocks a remote writer may still write into ----------------------------
    def quarantine_remote_blocks(self, request: Request) -> list[int]:
        """Moves the blocks a remote writer was given (those past the request's prefix hits)
        from the request into quarantine: the writer was not fenced. Returns their ids."""
        first = self.first_remote_block(request)
        unfenced = request.block_ids[first:]
        request.block_ids = request.block_ids[:first]
        request.num_registered_blocks = min(request.num_registered_blocks, first)
        self._quarantine(unfenced)
        return unfenced

    def replace_remote_blocks(self, request: Request) -> list[int]:
        """Quarantines the blocks a remote writer was given and puts fresh ones in their place,
        for another writer. Returns the quarantined ids."""
        first = self.first_remote_block(request)
        unfenced = request.block_ids[first:]
        if len(unfenced) > self.pool.num_free_blocks:
            raise InsufficientKVError(len(unfenced), self.pool.num_free_blocks)
        request.block_ids[first:] = self.pool.allocate(len(unfenced))
        request.num_registered_blocks = min(request.num_registered_blocks, first)
        self._quarantine(unfenced)
        return unfenced

    def release_quarantined(self, block_ids: list[int]) -> None:
        """Their writer is done or dead: the blocks are free again."""
        self.quarantined.difference_update(block_ids)
        self.pool.free(block_ids)

    def first_remote_block(self, request: Request) -> int:
        """For a request reserved for a remote prefill: the blocks before this one are its own
        prefix hits, whole blocks only; the sender skips them and writes the rest (a partly
        hit block included: it is recomputed and sent)."""
        return request.num_cached_tokens // self.block_size

    def _quarantine(self, block_ids: list[int]) -> None:
        """Each block keeps the one reference its request had: no request has it now."""
        for block_id in block_ids:
            block = self.pool.blocks[block_id]
            assert block.ref_cnt == 1 and block.block_hash is None, f"block {block_id} is shared"
        self.quarantined.update(block_ids)

    def check_integrity(self) -> None:
        """Raises with the numbers unless every block is free, in use or quarantined, exactly
        once: the pool's own bookkeeping, and each quarantined block held by the quarantine
        alone; and unless every host-tier slot is free or holds one block."""
        self.pool.check_integrity()
        if self.tier is not None:
            self.tier.check_integrity()
        ref_counts = [self.pool.blocks[i].ref_cnt for i in self.quarantined]
        problems = []
        if num_free := ref_counts.count(0):
            problems.append(f"{num_free} quarantined blocks are free")
        if num_shared := sum(1 for n in ref_counts if n > 1):
            problems.append(f"{num_shared} quarantined blocks are also in use")
        if problems:
            raise AssertionError("KV cache corrupt: " + "; ".join(problems))
