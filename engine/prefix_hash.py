"""The prefix cache's chained block hash: the engine caches full KV blocks under it, the router
looks a prompt's blocks up under it in the caches the workers publish. One function for both,
torch-free, so the two can never disagree."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

HASH_BYTES = 16


def hash_block(parent_hash: bytes | None, token_ids: Sequence[int] | np.ndarray) -> bytes:
    """Hash chain over full blocks: a block's hash covers every token before it too."""
    return _chain(parent_hash, np.asarray(token_ids, dtype=np.int64).tobytes())


def extend_block_hashes(hashes: list[bytes], token_ids: Sequence[int], block_size: int) -> None:
    """Appends the hashes of token_ids' full blocks that `hashes` does not hold yet."""
    start, end = len(hashes), len(token_ids) // block_size
    if end <= start:
        return
    # One conversion for all the new blocks (the engine calls this every step, the router on
    # every request), each block then a slice of its bytes.
    tokens = np.asarray(token_ids[start * block_size : end * block_size], dtype=np.int64)
    data, block_bytes = memoryview(tokens.tobytes()), block_size * tokens.itemsize
    parent = hashes[-1] if hashes else None
    for i in range(end - start):
        parent = _chain(parent, data[i * block_bytes : (i + 1) * block_bytes])
        hashes.append(parent)


def _chain(parent_hash: bytes | None, block: bytes | memoryview) -> bytes:
    digest = hashlib.blake2b(parent_hash or b"", digest_size=HASH_BYTES)
    digest.update(block)
    return digest.digest()


def prompt_block_hashes(prompt_token_ids: Sequence[int], block_size: int) -> tuple[bytes, ...]:
    """The hashes of the prompt blocks a prefix cache can serve: full blocks that end before
    the last prompt token, whose logits are always computed."""
    hashes: list[bytes] = []
    extend_block_hashes(hashes, prompt_token_ids[: len(prompt_token_ids) - 1], block_size)
    return tuple(hashes)
