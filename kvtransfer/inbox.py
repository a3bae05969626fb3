"""Receiver-side request table: which blocks each request still expects, and who waits for them."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvtransfer.errors import (
    KVCancelledError,
    KVHeaderMismatchError,
    KVPeerError,
    KVTimeoutError,
    KVTransferError,
)
from kvtransfer.layout import KVLayout
from kvtransfer.wire import BlockHeader

# Finished request ids remembered so that expect() refuses to reuse one: data still in flight
# for an earlier attempt would otherwise count towards the retry (retry under a new id).
_MAX_RECENT_IDS = 100_000


@dataclass(slots=True)
class Expected:
    request_id: str
    num_expected_blocks: int
    pending_block_ids: set[int]  # expected, not yet admitted by any header
    num_landing: int = 0  # admitted headers whose bytes are still being written
    writer_ids: set[str] = field(default_factory=set)  # peers admitted to write into these blocks
    # Blocks this agent holds for the request, full and unchanging while it is open, which a
    # peer may read (ask us to send) in the meantime: the decode worker's prefix-cache hits.
    readable_block_ids: frozenset[int] = frozenset()
    error: KVTransferError | None = None
    is_open: bool = True  # False once forgotten: from then on its bytes go nowhere
    done: threading.Event = field(default_factory=threading.Event)
    # Held while bytes are written into this request's blocks: forgetting the request takes it,
    # so no write can still be landing once forget() has returned.
    write_lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def num_landed(self) -> int:
        return self.num_expected_blocks - len(self.pending_block_ids) - self.num_landing


class Inbox:
    """Thread-safe: expect/wait/cancel come from the caller, admit/land from I/O threads."""

    def __init__(self, layout: KVLayout, num_blocks: int) -> None:
        self.layout = layout
        self.num_blocks = num_blocks
        self._lock = threading.Lock()
        self._requests: dict[str, Expected] = {}
        self._recent_ids: OrderedDict[str, None] = OrderedDict()

    def expect(
        self, request_id: str, block_ids: Sequence[int], readable_block_ids: Sequence[int] = ()
    ) -> None:
        ids, readable = set(block_ids), frozenset(readable_block_ids)
        if not ids or len(ids) != len(block_ids):
            raise ValueError(f"block ids must be non-empty and unique, got {list(block_ids)}")
        if min(ids | readable) < 0 or max(ids | readable) >= self.num_blocks:
            raise ValueError(
                f"block ids must lie in [0, {self.num_blocks}), got {sorted(ids | readable)}"
            )
        if ids & readable:
            raise ValueError(f"blocks {sorted(ids & readable)} are both expected and readable")
        with self._lock:
            if request_id in self._requests or request_id in self._recent_ids:
                raise ValueError(f"request id {request_id!r} was already used on this agent")
            self._requests[request_id] = Expected(
                request_id, len(ids), ids, readable_block_ids=readable
            )

    def check_readable(self, request_id: str, block_ids: Sequence[int]) -> None:
        """Raises unless the request is open and holds these blocks readable. Checked again
        after the bytes have left: the owner frees the blocks only after forgetting the request,
        so one that is still open then held them for the whole read."""
        with self._lock:
            entry = self._open_entry(request_id)
            unreadable = set(block_ids) - entry.readable_block_ids
        if unreadable or not block_ids:
            raise KVTransferError(
                request_id, f"blocks {sorted(unreadable)} are not readable for this request"
            )

    def finish_read(
        self, request_id: str, verdict: KVTransferError | None
    ) -> KVTransferError | None:
        """Our read's outcome (the holder's verdict, else how its bytes landed); forgets it."""
        with self._lock:
            entry = self._requests.get(request_id)
        if entry is None:
            error: KVTransferError | None = KVCancelledError(request_id, "read cancelled")
        elif verdict is not None or entry.error is not None:
            error = verdict or entry.error
        elif not entry.done.is_set():
            landed = f"{entry.num_landed} of {entry.num_expected_blocks} blocks landed"
            error = KVTransferError(request_id, f"holder reported done, but {landed}")
        else:
            error = None
        self.forget(request_id)
        return error

    def is_settled(self, request_id: str) -> bool:
        """Whether the request is gone or every block of it landed (or it failed)."""
        with self._lock:
            entry = self._requests.get(request_id)
        return entry is None or entry.done.is_set()

    def grant(self, request_id: str, layout: KVLayout, writer_id: str) -> None:
        """Admit a writer before it writes anything (one-sided backends); raises like admit()."""
        with self._lock:
            entry = self._open_entry(request_id)
            mismatch = self.layout.mismatch(layout)
            if mismatch is not None:
                error = KVHeaderMismatchError(request_id, mismatch)
                self._fail_locked(entry, error)
                raise error
            entry.writer_ids.add(writer_id)

    def admit(self, header: BlockHeader, writer_id: str) -> Expected:
        """Check a header against the expectation; a mismatch fails the request and raises."""
        with self._lock:
            entry = self._open_entry(header.request_id)
            error = self._check(header, entry)
            if error is not None:
                self._fail_locked(entry, error)
                raise error
            entry.pending_block_ids.difference_update(header.block_ids)
            entry.num_landing += 1
            entry.writer_ids.add(writer_id)
            return entry

    def _open_entry(self, request_id: str) -> Expected:
        entry = self._requests.get(request_id)
        if entry is None or entry.error is not None:
            raise KVCancelledError(
                request_id, "not expected here (unknown, cancelled, failed or finished)"
            )
        return entry

    def _check(self, header: BlockHeader, entry: Expected) -> KVTransferError | None:
        rid = header.request_id
        mismatch = self.layout.mismatch(header.layout)
        if mismatch is not None:
            return KVHeaderMismatchError(rid, mismatch)
        expected_bytes = len(header.block_ids) * self.layout.bytes_per_block
        if header.num_bytes != expected_bytes:
            return KVHeaderMismatchError(
                rid, f"num_bytes: expected {expected_bytes}, got {header.num_bytes}"
            )
        unexpected = set(header.block_ids) - entry.pending_block_ids
        if unexpected or len(set(header.block_ids)) != len(header.block_ids):
            return KVTransferError(
                rid, f"blocks {sorted(unexpected)} are not pending (or repeat) for this request"
            )
        return None

    def land(self, entry: Expected) -> None:
        """The bytes of one admitted header are all in place."""
        with self._lock:
            entry.num_landing -= 1
            if not entry.pending_block_ids and entry.num_landing == 0:
                entry.done.set()

    def fail(self, entry: Expected, error: KVTransferError) -> None:
        with self._lock:
            self._fail_locked(entry, error)

    def fail_writer(self, writer_id: str, reason: str) -> None:
        """A peer is gone: every unfinished request it had started to write fails."""
        with self._lock:
            for entry in self._requests.values():
                if writer_id in entry.writer_ids and not entry.done.is_set():
                    self._fail_locked(entry, KVPeerError(entry.request_id, reason))

    def fail_all(self, reason: str) -> None:
        with self._lock:
            for entry in self._requests.values():
                self._fail_locked(entry, KVCancelledError(entry.request_id, reason))

    def _fail_locked(self, entry: Expected, error: KVTransferError) -> None:
        if entry.error is None and not entry.done.is_set():
            entry.error = error
            entry.done.set()

    def wait(self, request_id: str, timeout_s: float) -> KVTransferError | None:
        """Block until the request completes (it is then forgotten) or fails (it stays, for
        cancel() to fence); returns the failure."""
        with self._lock:
            entry = self._requests.get(request_id)
        if entry is None:
            raise ValueError(f"wait() for request {request_id!r}, which is not expected")
        if not entry.done.wait(timeout_s):
            landed = f"{entry.num_landed} of {entry.num_expected_blocks} blocks landed"
            return KVTimeoutError(request_id, f"{landed} within {timeout_s} s")
        if entry.error is None:
            self.forget(request_id)
        return entry.error

    def forget(self, request_id: str) -> Expected | None:
        with self._lock:
            entry = self._requests.pop(request_id, None)
            self._recent_ids[request_id] = None
            if len(self._recent_ids) > _MAX_RECENT_IDS:
                self._recent_ids.popitem(last=False)
        if entry is not None:
            with entry.write_lock:
                entry.is_open = False
        return entry

    def num_open(self) -> int:
        with self._lock:
            return len(self._requests)
