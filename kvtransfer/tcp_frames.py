"""Framing of the tcp backend: [magic, header length, header JSON, payload] out, JSON acks back.

A read request is a frame of its own magic with no payload: its ack is the holder's verdict,
sent once the holder's own send of the blocks has resolved."""

from __future__ import annotations

import json
import socket
import struct
from dataclasses import dataclass

from kvtransfer.errors import KVTransferError, error_from_wire, error_kind
from kvtransfer.wire import BlockHeader, ReadRequest

_MAGIC = b"PDKV"
_READ_MAGIC = b"PDKR"
_PREFIX = struct.Struct("!4sI")  # magic, header length; the payload length is in the header
_ACK_PREFIX = struct.Struct("!I")
# A header lists block ids as JSON: 1 MiB is ~100k blocks, far past any one request.
MAX_HEADER_BYTES = 1 << 20


class ConnectionLostError(ConnectionError):
    """The peer closed the stream, or broke the framing (then the stream cannot be resynced)."""


def encode_frame_header(header: BlockHeader | ReadRequest) -> bytes:
    body = header.encode()
    magic = _READ_MAGIC if isinstance(header, ReadRequest) else _MAGIC
    return _PREFIX.pack(magic, len(body)) + body


def recv_exact(sock: socket.socket, num_bytes: int) -> bytes:
    buffer = bytearray(num_bytes)
    view = memoryview(buffer)
    got = 0
    while got < num_bytes:
        n = sock.recv_into(view[got:])
        if n == 0:
            raise ConnectionLostError(f"peer closed after {got} of {num_bytes} bytes")
        got += n
    return bytes(buffer)


def recv_frame_header(sock: socket.socket) -> BlockHeader | ReadRequest | None:
    """The next frame's header; None when the peer closed cleanly between frames."""
    first = sock.recv(_PREFIX.size)
    if not first:
        return None
    prefix = first + recv_exact(sock, _PREFIX.size - len(first))
    magic, length = _PREFIX.unpack(prefix)
    if magic not in (_MAGIC, _READ_MAGIC) or length > MAX_HEADER_BYTES:
        raise ConnectionLostError(f"bad frame prefix (magic {magic!r}, header length {length})")
    try:
        body = recv_exact(sock, length)
        return ReadRequest.decode(body) if magic == _READ_MAGIC else BlockHeader.decode(body)
    except ValueError as e:
        raise ConnectionLostError(str(e)) from e


@dataclass(frozen=True, slots=True)
class Ack:
    """The receiver's verdict on one frame, in frame order."""

    request_id: str
    error: KVTransferError | None

    def encode(self) -> bytes:
        body: dict[str, str | None] = {"request_id": self.request_id, "kind": None, "reason": None}
        if self.error is not None:
            body.update(kind=error_kind(self.error), reason=self.error.reason)
        data = json.dumps(body).encode()
        return _ACK_PREFIX.pack(len(data)) + data

    @classmethod
    def recv(cls, sock: socket.socket) -> Ack:
        (length,) = _ACK_PREFIX.unpack(recv_exact(sock, _ACK_PREFIX.size))
        if length > MAX_HEADER_BYTES:
            raise ConnectionLostError(f"ack of {length} bytes")
        try:
            body = json.loads(recv_exact(sock, length))
            request_id, kind = str(body["request_id"]), body["kind"]
            error = None if kind is None else error_from_wire(kind, request_id, str(body["reason"]))
        except (ValueError, KeyError, TypeError) as e:
            raise ConnectionLostError(f"malformed ack: {e!r}") from e
        return cls(request_id, error)
