"""Byte-level views of a block-major KV cache, where block b is one contiguous byte range."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def byte_view(kv_cache: torch.Tensor) -> memoryview:
    """A writable memoryview over the (CPU, contiguous) cache's bytes; no copy is made."""
    return memoryview(kv_cache.view(-1).view(torch.uint8).numpy())


def runs(block_ids: Sequence[int]) -> list[tuple[int, int]]:
    """Split ids, in order, into (first_id, count) runs of consecutive ids.

    A run is one byte range of the cache, so it moves in one syscall instead of one per block.
    """
    result: list[tuple[int, int]] = []
    for block_id in block_ids:
        if result and result[-1][0] + result[-1][1] == block_id:
            result[-1] = (result[-1][0], result[-1][1] + 1)
        else:
            result.append((block_id, 1))
    return result
