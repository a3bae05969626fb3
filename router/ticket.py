"""What admission and routing know about one request: its size, length bucket, arrival and
prompt block hashes."""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence
from dataclasses import dataclass

from pdserve.lengths import LengthBucket

AFFINITY_PREFIX_TOKENS = 256  # requests sharing this many leading tokens hash alike


@dataclass(frozen=True, slots=True)
class Ticket:
    request_id: str
    num_prompt_tokens: int
    max_tokens: int
    num_kv_blocks: int  # decode KV held at admission: prompt + an output reserve per sample
    bucket: LengthBucket
    arrival_s: float  # monotonic clock
    affinity_key: bytes  # the prompt's leading tokens, hashed (for the hash policy)
    block_size: int  # the workers' KV block size, which num_kv_blocks and block_hashes use
    # Decode workers this request was lost on (migration): never routed there again.
    excluded_decode_ids: frozenset[str] = frozenset()
    # The prompt's chained block hashes (engine.prefix_hash), for the prefix scorers: a
    # PromptBlockHashes, hashed as far as they are read.
    block_hashes: Sequence[bytes] = ()
    num_seqs: int = 1  # sequences in the decode batch: the request's n samples
    # Leading prompt tokens the chosen decode worker holds and lets a prefill worker read
    # (peer fetch): set once the decode worker is chosen, before the prefill worker is.
    held_prefix_tokens: int = 0

    @property
    def num_total_tokens(self) -> int:
        return self.num_prompt_tokens + self.max_tokens


def kv_blocks_held(
    num_prompt_tokens: int, num_output_tokens: int, block_size: int, num_seqs: int = 1
) -> int:
    """Decode KV blocks for num_seqs samples of one prompt, each num_output_tokens long: the
    prompt's full blocks are shared by every sample (the prefix cache), the rest are each's."""
    num_shared = num_prompt_tokens // block_size
    num_own = -(-(num_prompt_tokens + num_output_tokens) // block_size) - num_shared
    return num_shared + num_seqs * num_own


def affinity_key(prompt_token_ids: list[int]) -> bytes:
    prefix = array("I", prompt_token_ids[:AFFINITY_PREFIX_TOKENS]).tobytes()
    return hashlib.blake2b(prefix, digest_size=8).digest()
