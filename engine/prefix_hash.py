"""The prefix cache's chained block hash: the engine caches full KV blocks under it, the router
looks a prompt's blocks up under it in the caches the workers publish. One function for both,
torch-free, so the two can never disagree."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Sequence
from typing import overload

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


class PromptBlockHashes(Sequence[bytes]):
    """prompt_block_hashes(prompt, block_size), each hash computed when first read. The router
    reads a prompt's first block hash for every request (which workers hold it), and the
    hashes after it only while some worker holds the blocks before: a prompt no cache holds
    costs one hash, not one per block."""

    __slots__ = ("_prompt", "_block_size", "_hashes", "_len")

    def __init__(self, prompt_token_ids: Sequence[int], block_size: int) -> None:
        self._prompt = prompt_token_ids
        self._block_size = block_size
        self._hashes: list[bytes] = []
        self._len = max(0, len(prompt_token_ids) - 1) // block_size

    def __len__(self) -> int:
        return self._len

    @overload
    def __getitem__(self, i: int) -> bytes: ...
    @overload
    def __getitem__(self, i: slice) -> Sequence[bytes]: ...
    def __getitem__(self, i: int | slice) -> bytes | Sequence[bytes]:
        if isinstance(i, slice):
            return tuple(self)[i]
        index = i + self._len if i < 0 else i
        if not 0 <= index < self._len:
            raise IndexError(i)
        if index >= len(self._hashes):
            # Twice what is held, at least: a long walk hashes in a few numpy conversions.
            upto = min(self._len, max(index + 1, 2 * len(self._hashes)))
            extend_block_hashes(self._hashes, self._prompt[: upto * self._block_size],
                                self._block_size)  # fmt: skip
        return self._hashes[index]

    def __iter__(self) -> Iterator[bytes]:
        for i in range(self._len):
            yield self[i]
