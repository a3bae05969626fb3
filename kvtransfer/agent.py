"""The transfer agent interface both backends implement, and the handle of one send."""

from __future__ import annotations

import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import ClassVar

import torch

from kvtransfer.errors import KVTimeoutError, KVTransferError
from kvtransfer.inbox import Expected, Inbox
from kvtransfer.layout import KVLayout
from kvtransfer.metrics import KV_TRANSFER_BYTES, KV_TRANSFER_SECONDS


@dataclass(slots=True, eq=False)
class TransferHandle:
    """Completion of one send(): resolved exactly once, by the backend's I/O thread."""

    request_id: str
    num_bytes: int
    backend: str
    _started_s: float = field(default_factory=time.perf_counter, init=False)
    _done: threading.Event = field(default_factory=threading.Event, init=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False)
    _error: KVTransferError | None = field(default=None, init=False)

    def wait(self, timeout_s: float) -> None:
        """Returns once the receiver holds every byte of this send; raises KVTransferError."""
        if not self._done.wait(timeout_s):
            raise KVTimeoutError(
                self.request_id, f"send of {self.num_bytes} bytes not done within {timeout_s} s"
            )
        if self._error is not None:
            raise self._error

    def is_done(self) -> bool:
        """Whether the outcome is known (wait() would return or raise at once)."""
        return self._done.is_set()

    def resolve(self, error: KVTransferError | None = None) -> None:
        """Backend side: record the outcome; only the first call counts."""
        with self._lock:
            if self._done.is_set():
                return
            self._error = error
            self._done.set()
        if error is None:
            KV_TRANSFER_BYTES.labels(self.backend, "sent").inc(self.num_bytes)
            KV_TRANSFER_SECONDS.labels(self.backend).observe(time.perf_counter() - self._started_s)


@dataclass(slots=True, eq=False)
class Fence:
    """Whether the writers of a cancelled request have all stopped. One that is not done when
    cancel() returns may still write into the request's blocks: they must stay out of use until
    it is done (a writer's late confirmation sets it) or the writer is known dead."""

    writer_names: set[str] = field(default_factory=set)
    done: threading.Event = field(default_factory=threading.Event)

    def is_done(self) -> bool:
        return self.done.is_set()


def done_fence() -> Fence:
    fence = Fence()
    fence.done.set()
    return fence


class KVAgent(ABC):
    """One worker's end of KV transfers: receives into, and sends from, its paged KV cache.

    Receiver side (decode worker): expect() -> wait() or cancel().
    Sender side (prefill worker): send() per finished chunk, any number in flight.
    """

    backend: ClassVar[str]

    def __init__(self, kv_cache: torch.Tensor, layout: KVLayout) -> None:
        if not kv_cache.is_contiguous():
            raise ValueError("kv_cache must be contiguous: a block is sent as one byte range")
        mismatch = layout.mismatch(KVLayout.of(layout.model_id, kv_cache))
        if mismatch is not None:
            raise ValueError(f"layout does not describe kv_cache: {mismatch}")
        self.kv_cache = kv_cache
        self.layout = layout
        self.num_blocks = kv_cache.shape[0]
        self._inbox = Inbox(layout, self.num_blocks)

    @abstractmethod
    def metadata(self) -> bytes:
        """Opaque blob a peer needs to write into this agent (layout and address included)."""

    def expect(self, request_id: str, block_ids: Sequence[int]) -> None:
        """These destination blocks will be written for this request (call before any send)."""
        self._inbox.expect(request_id, block_ids)

    def wait(self, request_id: str, timeout_s: float) -> None:
        """Returns when every expected block has landed, and forgets the request. Raises
        KVTransferError otherwise, leaving it expected: cancel() it to fence its writers."""
        error = self._inbox.wait(request_id, timeout_s)
        if error is not None:
            raise error

    def cancel(self, request_id: str) -> Fence:
        """Forgets the request and stops its writers. When the returned fence is done, no late
        byte for it can land in its blocks; when not, a writer did not confirm in time."""
        entry = self._inbox.forget(request_id)
        return done_fence() if entry is None else self._fence(entry)

    @abstractmethod
    def send(
        self,
        peer_metadata: bytes,
        request_id: str,
        src_block_ids: Sequence[int],
        dst_block_ids: Sequence[int],
    ) -> TransferHandle:
        """Start writing our src blocks into the peer's dst blocks; returns at once."""

    @abstractmethod
    def close(self) -> None:
        """Release registrations, sockets and threads; open requests fail as cancelled."""

    @abstractmethod
    def _fence(self, entry: Expected) -> Fence:
        """Stops the writers of this forgotten request; waits a bounded time for them."""

    def _check_send_args(self, src_block_ids: Sequence[int], dst_block_ids: Sequence[int]) -> None:
        if not src_block_ids or len(src_block_ids) != len(dst_block_ids):
            raise ValueError(
                f"need as many src as dst block ids, got {len(src_block_ids)} and "
                f"{len(dst_block_ids)}"
            )
        if min(src_block_ids) < 0 or max(src_block_ids) >= self.num_blocks:
            raise ValueError(f"src block ids must lie in [0, {self.num_blocks})")
