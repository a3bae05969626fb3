"""Remote writers that did not confirm a cancel, watched until they are known done or dead.

A prefill worker that does not confirm a cancel within the fence timeout (stalled, SIGSTOPped,
or its transport wedged) could still land bytes in the blocks it was granted. The engine's KV
cache manager keeps those blocks quarantined (out of use); this watches each such writer and
has them released once it confirms after all (its fence settles) or nothing listens at its
address any more.
"""

from __future__ import annotations

import errno
import logging
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass

import kvtransfer

log = logging.getLogger(__name__)

CHECK_EVERY_S = 1.0
# connect() answers that mean no process holds the port (or the host is gone): the writer is
# dead. A timeout means nothing: a stopped process's socket still accepts connections.
_DEAD_ERRNOS = {errno.ECONNREFUSED, errno.EHOSTUNREACH, errno.ENETUNREACH}


@dataclass(frozen=True, slots=True, eq=False)
class UnfencedWriter:
    block_ids: list[int]  # quarantined: the blocks it was granted
    fence: kvtransfer.Fence
    writer_address: str  # the prefill worker's gRPC address (host:port)


class UnfencedWriters:
    """Thread-safe. A checker thread runs only while a writer is watched."""

    def __init__(self, release: Callable[[list[int]], None]) -> None:
        self._release = release  # has the engine release quarantined block ids
        self._entries: list[UnfencedWriter] = []
        self._lock = threading.Lock()
        self._checker: threading.Thread | None = None

    def watch(self, block_ids: list[int], fence: kvtransfer.Fence, writer_address: str) -> None:
        if not block_ids:
            return
        log.warning("quarantined KV blocks %s: writer %s did not confirm it stopped",
                    block_ids, writer_address)  # fmt: skip
        with self._lock:
            self._entries.append(UnfencedWriter(block_ids, fence, writer_address))
            if self._checker is None:
                self._checker = threading.Thread(
                    target=self._check_until_empty, name="kv-quarantine", daemon=True
                )
                self._checker.start()

    def _check_until_empty(self) -> None:
        stop = threading.Event()  # never set: the pause between checks
        while not stop.wait(CHECK_EVERY_S):
            with self._lock:
                entries = list(self._entries)
            settled = [e for e in entries if e.fence.is_done() or _is_gone(e.writer_address)]
            for entry in settled:
                log.info("released quarantined KV blocks %s (writer %s %s)", entry.block_ids,
                         entry.writer_address,
                         "confirmed" if entry.fence.is_done() else "is gone")  # fmt: skip
                self._release(entry.block_ids)
            with self._lock:
                self._entries = [e for e in self._entries if e not in settled]
                if not self._entries:
                    self._checker = None
                    return


def _is_gone(address: str) -> bool:
    host, _, port = address.rpartition(":")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=1.0).close()
    except OSError as e:
        return e.errno in _DEAD_ERRNOS
    return False
