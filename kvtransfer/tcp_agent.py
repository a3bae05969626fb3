"""TCP fallback backend: stdlib sockets, payload received straight into the destination blocks."""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
from collections.abc import Sequence
from functools import partial

import torch

from kvtransfer.agent import Fence, KVAgent, TransferHandle, done_fence
from kvtransfer.blocks import byte_view, runs
from kvtransfer.errors import KVCancelledError, KVPeerError, KVTransferError
from kvtransfer.inbox import Expected
from kvtransfer.layout import KVLayout
from kvtransfer.metrics import KV_TRANSFER_BYTES, KV_TRANSFER_MEMORY
from kvtransfer.staging import StagedReader, StagedWriter, ready_event
from kvtransfer.tcp_frames import Ack, ConnectionLostError, recv_frame_header
from kvtransfer.tcp_sender import (
    SOCKET_BUFFER_BYTES,
    BlockReader,
    DirectReader,
    TcpJob,
    TcpPeerConnection,
)
from kvtransfer.wire import BlockHeader, PeerMetadata, ReadRequest

# recv_into a block holds the request's write lock; this timeout bounds how long cancel() waits
# for a stalled sender to let go of it.
_RECV_SLICE_TIMEOUT_S = 0.05
_DISCARD_CHUNK_BYTES = 1 << 20
# A holder answers a read within this: a reader that takes longer to receive the blocks gets a
# timeout verdict, and its inbox drops whatever arrives later.
_PUSH_TIMEOUT_S = 30.0

logger = logging.getLogger(__name__)


class TcpAgent(KVAgent):
    backend = "tcp"

    def __init__(
        self, name: str, kv_cache: torch.Tensor, layout: KVLayout, host: str,
        staging: bool | None = None,
    ) -> None:  # fmt: skip
        """staging: bytes go through host bounce buffers; None = exactly when the cache is on
        a GPU (sockets move host memory only). A CPU cache is sent and received in place."""
        super().__init__(kv_cache, layout)
        self.name = name
        self.is_staged = kv_cache.is_cuda if staging is None else staging
        if kv_cache.is_cuda and not self.is_staged:
            raise ValueError("a CUDA kv_cache needs staging: sockets move host memory only")
        self._bytes = None if self.is_staged else byte_view(kv_cache)
        KV_TRANSFER_MEMORY.labels(self.backend, "staged" if self.is_staged else "DRAM").set(1)
        if self.is_staged:
            logger.info(
                "tcp KV transfer from %s memory: staged through pinned host buffers",
                kv_cache.device,
            )
        self._listener = socket.create_server((host, 0))
        self._address = (host, self._listener.getsockname()[1])
        self._lock = threading.Lock()
        self._peers: dict[tuple[str, int], TcpPeerConnection] = {}
        self._accepted: set[socket.socket] = set()
        self._closed = False
        self._acceptor = threading.Thread(target=self._accept_loop, name="kv-tcp-accept")
        self._acceptor.daemon = True
        self._acceptor.start()

    def metadata(self) -> bytes:
        endpoint = {"host": self._address[0], "port": self._address[1]}
        return PeerMetadata(self.backend, self.layout, self.num_blocks, endpoint).encode()

    # ---- sender side

    def send(
        self,
        peer_metadata: bytes,
        request_id: str,
        src_block_ids: Sequence[int],
        dst_block_ids: Sequence[int],
    ) -> TransferHandle:
        self._check_send_args(src_block_ids, dst_block_ids)
        num_bytes = len(src_block_ids) * self.layout.bytes_per_block
        handle = TransferHandle(request_id, num_bytes, self.backend)
        try:
            address = _parse_endpoint(peer_metadata)
        except ValueError as e:
            handle.resolve(KVTransferError(request_id, f"bad peer metadata: {e}"))
            return handle
        # No layout check here: the receiver is the authority and rejects a mismatched header
        # before writing a byte (see docs/kvtransfer.md).
        header = BlockHeader(request_id, self.layout, tuple(dst_block_ids), num_bytes)
        # Recorded here, on the engine thread, right after the step that wrote these blocks.
        job = TcpJob(header, tuple(src_block_ids), handle, ready_event(self.kv_cache))
        self._submit(address, job)
        return handle

    def _start_read(self, peer_metadata: bytes, read: ReadRequest, handle: TransferHandle) -> None:
        try:
            address = _parse_endpoint(peer_metadata)
        except ValueError as e:
            self._finish_read(handle, KVTransferError(read.request_id, f"bad peer metadata: {e}"))
            return
        # The frame's ack is the holder's verdict; it comes after its bytes reached our inbox.
        frame = TransferHandle(read.request_id, 0, self.backend, counts=False)
        frame.add_done_callback(partial(self._finish_read, handle))
        self._submit(address, TcpJob(read, (), frame))

    def _submit(self, address: tuple[str, int], job: TcpJob) -> None:
        with self._lock:
            if self._closed:
                job.handle.resolve(KVPeerError(job.header.request_id, "agent closed"))
                return
            connection = self._peers.get(address)
            if connection is None:
                connection = TcpPeerConnection(
                    address, self._reader(), self.layout.bytes_per_block, self._forget_peer
                )
                self._peers[address] = connection
        connection.submit(job)

    def _reader(self) -> BlockReader:
        return StagedReader(self.kv_cache) if self._bytes is None else DirectReader(self._bytes)

    def _forget_peer(self, connection: TcpPeerConnection) -> None:
        with self._lock:
            if self._peers.get(connection.address) is connection:
                del self._peers[connection.address]

    # ---- receiver side

    def _fence(self, entry: Expected) -> Fence:
        # Nothing to wait for: forget() took the request's write lock, so no recv_into into its
        # blocks is in progress, and every later byte for it is read into a scratch buffer.
        return done_fence()

    def _accept_loop(self) -> None:
        while True:
            try:
                sock, peer = self._listener.accept()
            except OSError:
                return  # the listener was closed
            with self._lock:
                if self._closed:
                    sock.close()
                    return
                self._accepted.add(sock)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SOCKET_BUFFER_BYTES)
            writer_id = f"tcp:{peer[0]}:{peer[1]}"
            thread = threading.Thread(
                target=self._serve, args=(sock, writer_id), name="kv-tcp-recv"
            )
            thread.daemon = True
            thread.start()

    def _serve(self, sock: socket.socket, writer_id: str) -> None:
        scratch = memoryview(bytearray(_DISCARD_CHUNK_BYTES))
        staged = StagedWriter(self.kv_cache) if self.is_staged else None
        reason = "closed by peer"
        try:
            while (header := recv_frame_header(sock)) is not None:
                if isinstance(header, ReadRequest):
                    ack = self._serve_read(header)
                else:
                    ack = self._receive_frame(sock, header, writer_id, scratch, staged)
                sock.sendall(ack.encode())
        except OSError as e:  # ConnectionLostError included
            reason = str(e)
        finally:
            # A request this peer had started and not finished can no longer complete.
            self._inbox.fail_writer(writer_id, f"connection from {writer_id} lost: {reason}")
            with self._lock:
                self._accepted.discard(sock)
            sock.close()

    def _serve_read(self, read: ReadRequest) -> Ack:
        """Holder side: push the blocks, then answer. This connection's later frames wait
        meanwhile (acks go back in frame order); the reader waits for this answer anyway."""
        push = self._push(read)
        try:
            push.wait(_PUSH_TIMEOUT_S)
            error = None
        except KVTransferError as e:
            error = e
        return Ack(read.request_id, self._read_verdict(read, error))

    def _receive_frame(
        self, sock: socket.socket, header: BlockHeader, writer_id: str, scratch: memoryview,
        staged: StagedWriter | None,
    ) -> Ack:  # fmt: skip
        try:
            entry = self._inbox.admit(header, writer_id)
        except KVTransferError as e:
            _discard(sock, header.num_bytes, scratch)
            return Ack(header.request_id, e)
        try:
            if staged is None:
                self._receive_blocks(sock, entry, header.block_ids, scratch)
            else:
                self._receive_staged(sock, entry, header.block_ids, staged)
        except ConnectionLostError as e:
            self._inbox.fail(entry, KVPeerError(entry.request_id, f"short write: {e}"))
            raise
        self._inbox.land(entry)
        if not entry.is_open:
            return Ack(header.request_id, KVCancelledError(header.request_id, "cancelled"))
        KV_TRANSFER_BYTES.labels(self.backend, "received").inc(header.num_bytes)
        return Ack(header.request_id, None)

    def _receive_blocks(
        self,
        sock: socket.socket,
        entry: Expected,
        block_ids: Sequence[int],
        scratch: memoryview,
    ) -> None:
        bpb = self.layout.bytes_per_block
        total, got = len(block_ids) * bpb, 0
        sock.settimeout(_RECV_SLICE_TIMEOUT_S)
        try:
            for first, count in runs(block_ids):
                target = self._bytes[first * bpb : (first + count) * bpb]
                offset = 0
                while offset < len(target):
                    with entry.write_lock:
                        into = target[offset:] if entry.is_open else scratch[: len(target) - offset]
                        try:
                            n = sock.recv_into(into)
                        except TimeoutError:
                            continue
                    if n == 0:
                        raise ConnectionLostError(f"peer closed after {got} of {total} bytes")
                    offset += n
                    got += n
        finally:
            sock.settimeout(None)

    def _receive_staged(
        self, sock: socket.socket, entry: Expected, block_ids: Sequence[int], staged: StagedWriter
    ) -> None:
        """Each chunk lands in this connection's bounce buffer (no lock needed), then goes into
        the blocks under the write lock, only while the request is open: once forget() has
        returned, no chunk of it reaches the cache."""
        bpb, chunk = self.layout.bytes_per_block, len(staged.view)
        total, got = len(block_ids) * bpb, 0
        for first, count in runs(block_ids):
            start, length = first * bpb, count * bpb
            for offset in range(0, length, chunk):
                n = min(chunk, length - offset)
                filled = 0
                while filled < n:
                    k = sock.recv_into(staged.view[filled:n])
                    if k == 0:
                        raise ConnectionLostError(f"peer closed after {got} of {total} bytes")
                    filled += k
                    got += k
                with entry.write_lock:
                    if entry.is_open:
                        staged.flush(n, start + offset)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            peers, self._peers = list(self._peers.values()), {}
            accepted = list(self._accepted)
        # shutdown wakes the thread blocked in accept(); close alone does not.
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()
        for connection in peers:
            connection.close()
        for sock in accepted:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
        self._acceptor.join(timeout=1.0)
        self._inbox.fail_all("agent closed")


def _parse_endpoint(peer_metadata: bytes) -> tuple[str, int]:
    peer = PeerMetadata.decode(peer_metadata)
    if peer.backend != TcpAgent.backend:
        raise ValueError(f"backend: expected {TcpAgent.backend}, got {peer.backend}")
    host, port = peer.endpoint.get("host"), peer.endpoint.get("port")
    if not isinstance(host, str) or not isinstance(port, int):
        raise ValueError(f"tcp endpoint needs host and port, got {peer.endpoint}")
    return host, port


def _discard(sock: socket.socket, num_bytes: int, scratch: memoryview) -> None:
    """Read a rejected payload off the stream so the next frame stays in sync."""
    left = num_bytes
    while left > 0:
        n = sock.recv_into(scratch[: min(left, len(scratch))])
        if n == 0:
            raise ConnectionLostError(f"peer closed with {left} payload bytes unread")
        left -= n
