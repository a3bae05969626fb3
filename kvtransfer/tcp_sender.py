"""Sender side of one cached tcp connection: frames go out in submit order, acks resolve them."""

from __future__ import annotations

import contextlib
import queue
import socket
import threading
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Protocol

import torch

from kvtransfer.agent import TransferHandle
from kvtransfer.blocks import runs
from kvtransfer.errors import KVPeerError
from kvtransfer.tcp_frames import Ack, ConnectionLostError, encode_frame_header
from kvtransfer.wire import BlockHeader, ReadRequest

CONNECT_TIMEOUT_S = 5.0
SOCKET_BUFFER_BYTES = 4 << 20


@dataclass(frozen=True, slots=True)
class TcpJob:
    """A send (header and its blocks as payload), or a read request (no payload)."""

    header: BlockHeader | ReadRequest
    src_block_ids: tuple[int, ...]
    handle: TransferHandle
    # A CUDA cache's blocks may be read once this is done (kvtransfer.staging.ready_event).
    ready: torch.cuda.Event | None = None


class BlockReader(Protocol):
    def chunks(
        self, start: int, length: int, after: torch.cuda.Event | None
    ) -> Iterator[memoryview]:
        """Host views of cache bytes [start, start + length), in order."""
        ...


class DirectReader:
    """A CPU cache's bytes as they are: one view per run of blocks, no copy."""

    def __init__(self, src_bytes: memoryview) -> None:
        self._bytes = src_bytes

    def chunks(self, start: int, length: int, after: torch.cuda.Event | None = None):
        yield self._bytes[start : start + length]


class TcpPeerConnection:
    """A writer thread sends frames in submit order; a reader thread resolves their handles from
    the receiver's acks, which come back in the same order. Any socket error fails every job
    not yet acked and retires the connection (the agent opens a new one on the next send)."""

    def __init__(
        self,
        address: tuple[str, int],
        reader: BlockReader,
        bytes_per_block: int,
        on_dead: Callable[[TcpPeerConnection], None],
    ) -> None:
        self.address = address
        self._reader = reader  # this connection's own: a staged reader's buffers are not shared
        self._bytes_per_block = bytes_per_block
        self._on_dead = on_dead
        self._lock = threading.Lock()
        self._jobs: queue.SimpleQueue[TcpJob | None] = queue.SimpleQueue()
        self._awaiting_ack: deque[TcpJob] = deque()
        self._dead_reason: str | None = None
        self._sock: socket.socket | None = None
        self._writer = threading.Thread(target=self._write_loop, name="kv-tcp-send", daemon=True)
        self._writer.start()

    def submit(self, job: TcpJob) -> None:
        with self._lock:
            if self._dead_reason is None:
                self._jobs.put(job)
                return
        job.handle.resolve(KVPeerError(job.header.request_id, self._dead_reason))

    def close(self) -> None:
        self._jobs.put(None)
        self._die("agent closed")

    def _write_loop(self) -> None:
        try:
            sock = socket.create_connection(self.address, timeout=CONNECT_TIMEOUT_S)
            sock.settimeout(None)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCKET_BUFFER_BYTES)
        except OSError as e:
            self._die(f"cannot connect to {self.address}: {e}")
            return
        with self._lock:
            if self._dead_reason is not None:
                sock.close()
                return
            self._sock = sock
        reader = threading.Thread(target=self._read_loop, args=(sock,), name="kv-tcp-ack")
        reader.daemon = True
        reader.start()
        try:
            while (job := self._jobs.get()) is not None:
                with self._lock:
                    if self._dead_reason is not None:
                        break
                    self._awaiting_ack.append(job)
                self._write_frame(sock, job)
        except OSError as e:
            self._die(f"connection to {self.address} lost while sending: {e}")
        finally:
            sock.close()

    def _write_frame(self, sock: socket.socket, job: TcpJob) -> None:
        sock.sendall(encode_frame_header(job.header))
        bpb = self._bytes_per_block
        for first, count in runs(job.src_block_ids):
            for chunk in self._reader.chunks(first * bpb, count * bpb, job.ready):
                sock.sendall(chunk)

    def _read_loop(self, sock: socket.socket) -> None:
        try:
            while True:
                ack = Ack.recv(sock)
                with self._lock:
                    job = self._awaiting_ack.popleft() if self._awaiting_ack else None
                if job is None or job.header.request_id != ack.request_id:
                    raise ConnectionLostError(f"ack for {ack.request_id!r} out of order")
                job.handle.resolve(ack.error)
        except OSError as e:
            self._die(f"connection to {self.address} lost: {e}")

    def _die(self, reason: str) -> None:
        with self._lock:
            if self._dead_reason is not None:
                return
            self._dead_reason = reason
            failed = list(self._awaiting_ack)
            self._awaiting_ack.clear()
            while True:
                try:
                    job = self._jobs.get_nowait()
                except queue.Empty:
                    break
                if job is not None:
                    failed.append(job)
            sock = self._sock
        self._jobs.put(None)  # wakes the writer if it waits for a job
        if sock is not None:
            # shutdown, not close: it wakes a thread blocked on the socket, and the writer
            # thread, which owns the socket, closes it.
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
        for job in failed:
            job.handle.resolve(KVPeerError(job.header.request_id, reason))
        self._on_dead(self)
