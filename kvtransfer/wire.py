"""What travels between agents besides KV bytes: peer metadata and per-transfer block headers."""

from __future__ import annotations

import base64
import json
from dataclasses import dataclass
from typing import Any

from kvtransfer.layout import KVLayout

_METADATA_VERSION = 1


def _as_int(value: Any, name: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"{name} must be a non-negative int, got {value!r}")
    return value


@dataclass(frozen=True, slots=True)
class PeerMetadata:
    """What a sender needs to write into an agent's blocks; published in the worker registry."""

    backend: str  # "nixl" | "tcp"
    layout: KVLayout
    num_blocks: int
    endpoint: dict[str, Any]  # backend-specific: tcp {host, port}; nixl see nixl_agent.py

    def encode(self) -> bytes:
        return json.dumps(
            {
                "version": _METADATA_VERSION,
                "backend": self.backend,
                "layout": self.layout.to_dict(),
                "num_blocks": self.num_blocks,
                "endpoint": self.endpoint,
            }
        ).encode()

    @classmethod
    def decode(cls, blob: bytes) -> PeerMetadata:
        """Raises ValueError on anything malformed: the blob arrives over the network."""
        try:
            data = json.loads(blob)
            if data["version"] != _METADATA_VERSION:
                raise ValueError(f"metadata version {data['version']}, want {_METADATA_VERSION}")
            return cls(
                backend=str(data["backend"]),
                layout=KVLayout.from_dict(data["layout"]),
                num_blocks=_as_int(data["num_blocks"], "num_blocks"),
                endpoint=dict(data["endpoint"]),
            )
        except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as e:
            raise ValueError(f"malformed KV agent metadata: {e!r}") from e


class _JsonMessage:
    """A message that travels as the JSON of its to_dict(), and is parsed by its from_dict()."""

    __slots__ = ()
    WHAT = "message"  # in the error a malformed one raises

    def encode(self) -> bytes:
        return json.dumps(self.to_dict()).encode()  # type: ignore[attr-defined]

    @classmethod
    def decode(cls, blob: bytes) -> Any:
        try:
            data = json.loads(blob)
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ValueError(f"malformed {cls.WHAT}: {e!r}") from e
        return cls.from_dict(data)  # type: ignore[attr-defined]


@dataclass(frozen=True, slots=True)
class BlockHeader(_JsonMessage):
    """Announces the bytes of one send(): the receiver checks it against its own layout."""

    request_id: str
    layout: KVLayout
    block_ids: tuple[int, ...]  # destination blocks, in payload order
    num_bytes: int
    WHAT = "block header"

    def to_dict(self) -> dict[str, Any]:
        return {
            "request_id": self.request_id,
            "layout": self.layout.to_dict(),
            "block_ids": list(self.block_ids),
            "num_bytes": self.num_bytes,
        }

    @classmethod
    def from_dict(cls, data: Any) -> BlockHeader:
        """Raises ValueError on anything malformed: the header arrives over the network."""
        try:
            return cls(
                request_id=str(data["request_id"]),
                layout=KVLayout.from_dict(data["layout"]),
                block_ids=tuple(_as_int(b, "block id") for b in data["block_ids"]),
                num_bytes=_as_int(data["num_bytes"], "num_bytes"),
            )
        except (KeyError, TypeError) as e:
            raise ValueError(f"malformed block header: {e!r}") from e


@dataclass(frozen=True, slots=True)
class ReadRequest(_JsonMessage):
    """Asks a holder to send blocks it holds for an open request into the reader's blocks: the
    holder writes them through its ordinary send, so the reader's inbox checks their header."""

    request_id: str
    src_block_ids: tuple[int, ...]  # the holder's blocks
    dst_block_ids: tuple[int, ...]  # the reader's blocks, in the same order
    reader_metadata: bytes  # the reader's PeerMetadata blob: where the holder sends them
    WHAT = "read request"

    def to_dict(self) -> dict[str, Any]:
        return {
            "request_id": self.request_id,
            "src_block_ids": list(self.src_block_ids),
            "dst_block_ids": list(self.dst_block_ids),
            "reader_metadata": base64.b64encode(self.reader_metadata).decode(),
        }

    @classmethod
    def from_dict(cls, data: Any) -> ReadRequest:
        """Raises ValueError on anything malformed: the request arrives over the network."""
        try:
            return cls(
                request_id=str(data["request_id"]),
                src_block_ids=tuple(_as_int(b, "block id") for b in data["src_block_ids"]),
                dst_block_ids=tuple(_as_int(b, "block id") for b in data["dst_block_ids"]),
                reader_metadata=base64.b64decode(data["reader_metadata"], validate=True),
            )
        except (KeyError, TypeError) as e:  # a bad base64 blob raises ValueError itself
            raise ValueError(f"malformed read request: {e!r}") from e
