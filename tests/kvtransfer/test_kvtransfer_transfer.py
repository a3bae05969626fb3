"""Real processes move real paged-cache blocks, over each backend, and fail cleanly."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest
import torch
from kv_peers import (
    AgentHost,
    CacheSpec,
    backend_of,
    block_bytes,
    bytes_sent,
    cancel,
    close,
    create,
    expect,
    read,
    read_cache,
    send,
    wait,
)

from kvtransfer import (
    KVCancelledError,
    KVHeaderMismatchError,
    KVPeerError,
    KVTimeoutError,
    KVTransferError,
)

BACKENDS = ["nixl", "tcp"]
TIMEOUT_S = 10.0
_request_ids = (f"req-{i}" for i in itertools.count())


@dataclass(slots=True)
class Pair:
    """A receiver (decode-like) and a sender (prefill-like) process, agents created on demand."""

    backend: str
    receiver: AgentHost
    sender: AgentHost
    metadata: dict[str, bytes] = field(default_factory=dict)

    def agent(self, host: AgentHost, spec: CacheSpec) -> str:
        role = "receiver" if host is self.receiver else "sender"
        key = f"{role}-{spec.dtype}-bs{spec.block_size}"
        if key not in self.metadata:
            self.metadata[key] = host.call(create, key, self.backend, spec, len(self.metadata))
        return key


@pytest.fixture(scope="module", params=BACKENDS)
def pair(request: pytest.FixtureRequest) -> Iterator[Pair]:
    receiver, sender = AgentHost(), AgentHost()
    yield Pair(request.param, receiver, sender)
    receiver.stop()
    sender.stop()


def _expected_after(
    before: torch.Tensor, source: torch.Tensor, src_ids: list[int], dst_ids: list[int]
) -> torch.Tensor:
    expected = block_bytes(before).clone()
    expected[dst_ids] = block_bytes(source)[src_ids]
    return expected


# One block of SmolLM2-135M: 30 layers * (K, V) * 16 tokens * 3 heads * (64 dims * itemsize, or
# 64 int8 values + a 2-byte scale): an int8 cache ships 33/128 of fp32's bytes, 33/64 of bf16's.
BYTES_PER_BLOCK = {"float32": 737_280, "bfloat16": 368_640, "int8": 190_080}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int8"])
def test_blocks_land_byte_for_byte_in_scattered_destinations(pair: Pair, dtype: str) -> None:
    spec = CacheSpec(dtype)
    rx, tx = pair.agent(pair.receiver, spec), pair.agent(pair.sender, spec)
    assert pair.receiver.call(backend_of, rx) == pair.backend
    src_ids, dst_ids = [0, 1, 2, 5, 7], [9, 3, 4, 0, 11]
    before = pair.receiver.call(read_cache, rx)
    source = pair.sender.call(read_cache, tx)
    sent_before = pair.sender.call(bytes_sent, pair.backend)
    request_id = next(_request_ids)

    pair.receiver.call(expect, rx, request_id, dst_ids)
    # Two chunks in flight at once, as chunked prefill sends them.
    chunks = [(src_ids[:2], dst_ids[:2]), (src_ids[2:], dst_ids[2:])]
    pair.sender.call(send, tx, pair.metadata[rx], request_id, chunks, TIMEOUT_S)
    pair.receiver.call(wait, rx, request_id, TIMEOUT_S)

    after = block_bytes(pair.receiver.call(read_cache, rx))
    assert torch.equal(after, _expected_after(before, source, src_ids, dst_ids))
    assert after.shape[1] == BYTES_PER_BLOCK[dtype]
    assert pair.sender.call(bytes_sent, pair.backend) - sent_before == 5 * BYTES_PER_BLOCK[dtype]


@pytest.mark.parametrize(
    ("sender_spec", "reason"),
    [
        (CacheSpec("bfloat16"), "dtype: expected float32, got bfloat16"),
        (CacheSpec("int8"), "dtype: expected float32, got int8"),
        (CacheSpec("float32", block_size=8), "block_size: expected 16, got 8"),
    ],
)
def test_mismatched_header_is_rejected_naming_the_field(
    pair: Pair, sender_spec: CacheSpec, reason: str
) -> None:
    rx = pair.agent(pair.receiver, CacheSpec("float32"))
    tx = pair.agent(pair.sender, sender_spec)
    before = pair.receiver.call(read_cache, rx)
    request_id = next(_request_ids)

    pair.receiver.call(expect, rx, request_id, [2, 3])
    with pytest.raises(KVHeaderMismatchError, match=f"^request {request_id}: {reason}$"):
        pair.sender.call(send, tx, pair.metadata[rx], request_id, [([0, 1], [2, 3])], TIMEOUT_S)
    with pytest.raises(KVHeaderMismatchError, match=f"^request {request_id}: {reason}$"):
        pair.receiver.call(wait, rx, request_id, TIMEOUT_S)

    assert torch.equal(block_bytes(pair.receiver.call(read_cache, rx)), block_bytes(before))


@pytest.mark.parametrize("num_blocks_landed", [0, 1])
def test_cancelled_request_takes_no_late_data(pair: Pair, num_blocks_landed: int) -> None:
    spec = CacheSpec("float32")
    rx, tx = pair.agent(pair.receiver, spec), pair.agent(pair.sender, spec)
    before = pair.receiver.call(read_cache, rx)
    source = pair.sender.call(read_cache, tx)
    request_id = next(_request_ids)
    src_ids, dst_ids = [0, 1], [6, 8]

    pair.receiver.call(expect, rx, request_id, dst_ids)
    landed = [(src_ids[:num_blocks_landed], dst_ids[:num_blocks_landed])]
    if num_blocks_landed:
        pair.sender.call(send, tx, pair.metadata[rx], request_id, landed, TIMEOUT_S)
    # A sender that has written (and so was admitted) is stopped before cancel() returns.
    pair.receiver.call(cancel, rx, request_id)
    late = [(src_ids[num_blocks_landed:], dst_ids[num_blocks_landed:])]
    with pytest.raises(KVCancelledError):
        pair.sender.call(send, tx, pair.metadata[rx], request_id, late, TIMEOUT_S)

    after = block_bytes(pair.receiver.call(read_cache, rx))
    landed_src, landed_dst = landed[0]
    assert torch.equal(after, _expected_after(before, source, landed_src, landed_dst))


# tcp sees the connection drop; NIXL gives no such signal, so the receiver's deadline fires.
_KILLED_SENDER_ERROR = {"tcp": KVPeerError, "nixl": KVTimeoutError}


def test_sender_killed_mid_transfer_fails_only_its_request(pair: Pair) -> None:
    spec = CacheSpec("float32")
    rx, tx = pair.agent(pair.receiver, spec), pair.agent(pair.sender, spec)
    doomed = AgentHost()
    try:
        doomed.call(create, "doomed", pair.backend, spec, 99)
        doomed_request, other_request = next(_request_ids), next(_request_ids)
        pair.receiver.call(expect, rx, doomed_request, [1, 2, 3, 4])
        pair.receiver.call(expect, rx, other_request, [10])
        # Half of the request lands, then the sender dies without a word.
        doomed.call(send, "doomed", pair.metadata[rx], doomed_request, [([0, 1], [1, 2])], 10.0)
        doomed.kill()

        with pytest.raises(KVTransferError) as failure:
            pair.receiver.call(wait, rx, doomed_request, 3.0)
        assert type(failure.value) is _KILLED_SENDER_ERROR[pair.backend]
        assert failure.value.request_id == doomed_request
    finally:
        doomed.stop()

    # The receiver still serves: the other request, then a brand-new one.
    before = pair.receiver.call(read_cache, rx)
    source = pair.sender.call(read_cache, tx)
    pair.sender.call(send, tx, pair.metadata[rx], other_request, [([4], [10])], TIMEOUT_S)
    pair.receiver.call(wait, rx, other_request, TIMEOUT_S)
    new_request = next(_request_ids)
    pair.receiver.call(expect, rx, new_request, [1, 2, 3, 4])
    pair.sender.call(send, tx, pair.metadata[rx], new_request, [([5, 6, 7, 8], [1, 2, 3, 4])], 10)
    pair.receiver.call(wait, rx, new_request, TIMEOUT_S)

    after = block_bytes(pair.receiver.call(read_cache, rx))
    assert torch.equal(after, _expected_after(before, source, [4, 5, 6, 7, 8], [10, 1, 2, 3, 4]))


# ---- reads: the sender (prefill-like) reads blocks the receiver (decode-like) holds readable


def test_read_copies_the_holders_blocks_byte_for_byte(pair: Pair) -> None:
    spec = CacheSpec("float32")
    holder, reader = pair.agent(pair.receiver, spec), pair.agent(pair.sender, spec)
    src_ids, dst_ids = [2, 3, 5], [7, 0, 1]
    before = pair.sender.call(read_cache, reader)
    source = pair.receiver.call(read_cache, holder)
    sent_before = pair.receiver.call(bytes_sent, pair.backend)
    received_before = pair.sender.call(bytes_sent, pair.backend, "received")
    request_id = next(_request_ids)

    pair.receiver.call(expect, holder, request_id, [10], [2, 3, 5, 6])
    pair.sender.call(read, reader, pair.metadata[holder], request_id, src_ids, dst_ids, TIMEOUT_S)

    after = block_bytes(pair.sender.call(read_cache, reader))
    assert torch.equal(after, _expected_after(before, source, src_ids, dst_ids))
    num_bytes = 3 * BYTES_PER_BLOCK["float32"]
    assert pair.receiver.call(bytes_sent, pair.backend) - sent_before == num_bytes
    assert pair.sender.call(bytes_sent, pair.backend, "received") - received_before == num_bytes
    # The holder's request goes on as a remote prefill's: the rest is sent, and it completes.
    pair.sender.call(send, reader, pair.metadata[holder], request_id, [([4], [10])], TIMEOUT_S)
    pair.receiver.call(wait, holder, request_id, TIMEOUT_S)


@pytest.mark.parametrize(
    ("src_ids", "reason"),
    [
        ([2, 9], r"blocks \[9\] are not readable for this request"),
        ([10], r"blocks \[10\] are not readable for this request"),  # expected, not held
        ([40], r"blocks \[40\] are not readable for this request"),  # past the cache
    ],
)
def test_read_of_blocks_not_readable_fails_and_writes_nothing(
    pair: Pair, src_ids: list[int], reason: str
) -> None:
    spec = CacheSpec("float32")
    holder, reader = pair.agent(pair.receiver, spec), pair.agent(pair.sender, spec)
    before = pair.sender.call(read_cache, reader)
    request_id = next(_request_ids)
    pair.receiver.call(expect, holder, request_id, [10], [2, 3])

    with pytest.raises(KVTransferError, match=f"^request {request_id}: {reason}$"):
        dst_ids = list(range(len(src_ids)))
        pair.sender.call(
            read, reader, pair.metadata[holder], request_id, src_ids, dst_ids, TIMEOUT_S
        )
    assert torch.equal(block_bytes(pair.sender.call(read_cache, reader)), block_bytes(before))
    pair.receiver.call(cancel, holder, request_id)


@pytest.mark.parametrize("is_known", [False, True])
def test_read_of_an_unknown_or_cancelled_request_is_cancelled(pair: Pair, is_known: bool) -> None:
    spec = CacheSpec("float32")
    holder, reader = pair.agent(pair.receiver, spec), pair.agent(pair.sender, spec)
    request_id = next(_request_ids)
    if is_known:  # the holder let go of the request: its blocks may be reused already
        pair.receiver.call(expect, holder, request_id, [10], [2])
        pair.receiver.call(cancel, holder, request_id)
    with pytest.raises(KVCancelledError, match=f"^request {request_id}: not expected here"):
        pair.sender.call(read, reader, pair.metadata[holder], request_id, [2], [3], TIMEOUT_S)


def test_read_across_layouts_is_refused_by_the_reader(pair: Pair) -> None:
    holder = pair.agent(pair.receiver, CacheSpec("bfloat16"))
    reader = pair.agent(pair.sender, CacheSpec("float32"))
    before = pair.sender.call(read_cache, reader)
    request_id = next(_request_ids)
    pair.receiver.call(expect, holder, request_id, [10], [2])

    reason = "dtype: expected float32, got bfloat16"
    with pytest.raises(KVHeaderMismatchError, match=f"^request {request_id}: {reason}$"):
        pair.sender.call(read, reader, pair.metadata[holder], request_id, [2], [3], TIMEOUT_S)
    assert torch.equal(block_bytes(pair.sender.call(read_cache, reader)), block_bytes(before))
    pair.receiver.call(cancel, holder, request_id)


def test_read_from_a_closed_agent_or_bad_metadata_fails(pair: Pair) -> None:
    spec = CacheSpec("float32", num_blocks=2)
    holder = pair.agent(pair.receiver, CacheSpec("float32"))
    pair.sender.call(create, "closed", pair.backend, spec, 7)
    pair.sender.call(close, "closed")
    request_id = next(_request_ids)
    with pytest.raises(KVPeerError, match=f"^request {request_id}: agent closed$"):
        pair.sender.call(read, "closed", pair.metadata[holder], request_id, [2], [1], TIMEOUT_S)
    reader = pair.agent(pair.sender, CacheSpec("float32"))
    with pytest.raises(KVTransferError, match="bad peer metadata"):
        pair.sender.call(read, reader, b"{}", next(_request_ids), [2], [1], TIMEOUT_S)


def test_auto_prefers_nixl_here() -> None:
    host = AgentHost()
    try:
        host.call(create, "auto", "auto", CacheSpec("float32", num_blocks=2), 0)
        assert host.call(backend_of, "auto") == "nixl"
    finally:
        host.stop()
