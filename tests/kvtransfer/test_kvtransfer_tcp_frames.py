"""The tcp receiver against hand-made frames: short writes and bad headers hit one request only."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest
import torch
from kv_peers import block_bytes

from kvtransfer import (
    KVAgent,
    KVCancelledError,
    KVHeaderMismatchError,
    KVLayout,
    KVPeerError,
    KVTransferError,
    create_agent,
)
from kvtransfer.tcp_frames import Ack, encode_frame_header
from kvtransfer.wire import BlockHeader, PeerMetadata

# [num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]: 1,024 bytes per fp32 block
SHAPE = (6, 2, 2, 4, 2, 8)
BYTES_PER_BLOCK = 1024


def _cache(fill: int) -> torch.Tensor:
    cache = torch.empty(SHAPE)
    cache.view(-1).view(torch.uint8).fill_(fill)
    return cache


@pytest.fixture
def receiver() -> Iterator[KVAgent]:
    cache = _cache(0)
    agent = create_agent("tcp", "receiver", cache, KVLayout.of("m", cache))
    yield agent
    agent.close()


def _connect(agent: KVAgent) -> socket.socket:
    endpoint = PeerMetadata.decode(agent.metadata()).endpoint
    return socket.create_connection((endpoint["host"], endpoint["port"]))


def test_short_write_fails_its_request_and_spares_the_others(receiver: KVAgent) -> None:
    receiver.expect("short", [0, 1])
    receiver.expect("fine", [4])
    header = BlockHeader("short", receiver.layout, (0, 1), 2 * BYTES_PER_BLOCK)
    with _connect(receiver) as raw:
        raw.sendall(encode_frame_header(header) + b"\x07" * 1000)
    with pytest.raises(KVPeerError, match="short write: peer closed after 1000 of 2048 bytes"):
        receiver.wait("short", 5.0)

    source = _cache(9)
    sender = create_agent("tcp", "sender", source, KVLayout.of("m", source))
    try:
        sender.send(receiver.metadata(), "fine", [3], [4]).wait(5.0)
        receiver.wait("fine", 5.0)
    finally:
        sender.close()
    assert torch.equal(block_bytes(receiver.kv_cache)[4], block_bytes(source)[3])
    assert int(block_bytes(receiver.kv_cache)[[2, 3, 5]].count_nonzero()) == 0


@pytest.mark.parametrize(
    ("block_ids", "num_bytes", "error", "reason"),
    [
        ((2,), 1000, KVHeaderMismatchError, "num_bytes: expected 1024, got 1000"),
        ((3,), 1024, KVTransferError, r"blocks \[3\] are not pending"),
    ],
)
def test_bad_header_is_rejected_before_a_byte_is_written(
    receiver: KVAgent,
    block_ids: tuple[int, ...],
    num_bytes: int,
    error: type[KVTransferError],
    reason: str,
) -> None:
    receiver.expect("bad", [2])
    header = BlockHeader("bad", receiver.layout, block_ids, num_bytes)
    with _connect(receiver) as raw:
        raw.sendall(encode_frame_header(header) + b"\x07" * num_bytes)
        ack = Ack.recv(raw)
        # The stream stays in sync: a frame for an unknown request gets its own verdict.
        unknown = BlockHeader("unknown", receiver.layout, (5,), BYTES_PER_BLOCK)
        raw.sendall(encode_frame_header(unknown) + b"\x07" * BYTES_PER_BLOCK)
        unknown_ack = Ack.recv(raw)
    assert type(ack.error) is error
    assert ack.error.request_id == "bad"
    assert isinstance(unknown_ack.error, KVCancelledError)
    with pytest.raises(error, match=reason):
        receiver.wait("bad", 5.0)
    assert int(block_bytes(receiver.kv_cache).count_nonzero()) == 0
