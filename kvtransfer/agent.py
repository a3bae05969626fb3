"""The transfer agent interface both backends implement, and the handle of one send."""

from __future__ import annotations

import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import ClassVar

import torch

from kvtransfer.errors import KVTimeoutError, KVTransferError
from kvtransfer.inbox import Expected, Inbox
from kvtransfer.layout import KVLayout
from kvtransfer.metrics import KV_TRANSFER_BYTES, KV_TRANSFER_SECONDS
from kvtransfer.wire import ReadRequest


@dataclass(slots=True, eq=False)
class TransferHandle:
    """Completion of one send() or read(): resolved exactly once, by the backend's I/O thread."""

    request_id: str
    num_bytes: int
    backend: str
    # A send counts its bytes and seconds; a read's bytes are counted by the holder's send
    # and the reader's inbox, which carry them.
    counts: bool = True
    _started_s: float = field(default_factory=time.perf_counter, init=False)
    _done: threading.Event = field(default_factory=threading.Event, init=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False)
    _error: KVTransferError | None = field(default=None, init=False)
    _callbacks: list[Callable[[KVTransferError | None], None]] = field(
        default_factory=list, init=False
    )

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

    def add_done_callback(self, fn: Callable[[KVTransferError | None], None]) -> None:
        """fn(error) runs once the outcome is known, on the resolving thread (at once if it is)."""
        with self._lock:
            if not self._done.is_set():
                self._callbacks.append(fn)
                return
        fn(self._error)

    def resolve(self, error: KVTransferError | None = None) -> None:
        """Backend side: record the outcome; only the first call counts."""
        with self._lock:
            if self._done.is_set():
                return
            self._error = error
            self._done.set()
            callbacks, self._callbacks = self._callbacks, []
        if error is None and self.counts:
            KV_TRANSFER_BYTES.labels(self.backend, "sent").inc(self.num_bytes)
            KV_TRANSFER_SECONDS.labels(self.backend).observe(time.perf_counter() - self._started_s)
        for fn in callbacks:
            fn(error)


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
    Reader side (prefill worker): read() a prefix a peer holds for an open request, which the
    holder answers by sending those blocks into ours (see docs/kvtransfer.md, reads).
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

    def expect(
        self, request_id: str, block_ids: Sequence[int], readable_block_ids: Sequence[int] = ()
    ) -> None:
        """These destination blocks will be written for this request (call before any send).
        readable_block_ids: blocks we hold for it, full and unchanged until the request is
        forgotten (wait() done, or cancel()), which a peer may read() meanwhile."""
        self._inbox.expect(request_id, block_ids, readable_block_ids)

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

    def read(
        self,
        peer_metadata: bytes,
        request_id: str,
        src_block_ids: Sequence[int],
        dst_block_ids: Sequence[int],
    ) -> TransferHandle:
        """Start copying the peer's src blocks, readable for its open request request_id, into
        our dst blocks; returns at once. The handle resolves once they hold the bytes and the
        holder confirmed it held the blocks until they had left. After a failure or a wait that
        timed out, cancel(request_id): dst blocks may be reused once its fence is done."""
        _check_pairs(src_block_ids, dst_block_ids)
        # Registered like an expected send: the holder's bytes pass our inbox's header check,
        # and cancel() fences the holder as it fences any writer.
        self._inbox.expect(request_id, dst_block_ids)
        handle = TransferHandle(
            request_id, len(dst_block_ids) * self.layout.bytes_per_block, self.backend, False
        )
        read = ReadRequest(request_id, tuple(src_block_ids), tuple(dst_block_ids), self.metadata())
        self._start_read(peer_metadata, read, handle)
        return handle

    @abstractmethod
    def _start_read(self, peer_metadata: bytes, read: ReadRequest, handle: TransferHandle) -> None:
        """Hands the read request to the holder; resolves handle through _finish_read."""

    def _finish_read(self, handle: TransferHandle, verdict: KVTransferError | None) -> None:
        handle.resolve(self._inbox.finish_read(handle.request_id, verdict))

    def _push(self, read: ReadRequest) -> TransferHandle:
        """Holder side of a peer's read: send it the blocks if it may read them."""
        try:
            self._inbox.check_readable(read.request_id, read.src_block_ids)
            return self.send(
                read.reader_metadata, read.request_id, read.src_block_ids, read.dst_block_ids
            )
        except (KVTransferError, ValueError) as e:
            handle = TransferHandle(read.request_id, 0, self.backend, False)
            error = (
                e if isinstance(e, KVTransferError) else KVTransferError(read.request_id, str(e))
            )
            handle.resolve(error)
            return handle

    def _read_verdict(
        self, read: ReadRequest, error: KVTransferError | None
    ) -> KVTransferError | None:
        """Once the push resolved: its failure, or whether the blocks are still held for the
        request (then they were for the whole push: see Inbox.check_readable)."""
        if error is not None:
            return error
        try:
            self._inbox.check_readable(read.request_id, read.src_block_ids)
        except KVTransferError as e:
            return e
        return None

    @abstractmethod
    def close(self) -> None:
        """Release registrations, sockets and threads; open requests fail as cancelled."""

    @abstractmethod
    def _fence(self, entry: Expected) -> Fence:
        """Stops the writers of this forgotten request; waits a bounded time for them."""

    def _check_send_args(self, src_block_ids: Sequence[int], dst_block_ids: Sequence[int]) -> None:
        _check_pairs(src_block_ids, dst_block_ids)
        if min(src_block_ids) < 0 or max(src_block_ids) >= self.num_blocks:
            raise ValueError(f"src block ids must lie in [0, {self.num_blocks})")


def _check_pairs(src_block_ids: Sequence[int], dst_block_ids: Sequence[int]) -> None:
    if not src_block_ids or len(src_block_ids) != len(dst_block_ids):
        raise ValueError(
            f"need as many src as dst block ids, got {len(src_block_ids)} and {len(dst_block_ids)}"
        )
