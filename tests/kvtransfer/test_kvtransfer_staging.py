"""Host staging, the path a CUDA KV cache takes where the transport cannot move GPU memory: forced
on here over CPU caches, through real processes, it must move blocks byte for byte (in chunks
that do not line up with blocks) and keep cancellation's guarantee."""

from __future__ import annotations

import ctypes
import itertools
from collections.abc import Iterator

import pytest
import torch
from kv_peers import (
    MODEL_ID,
    AgentHost,
    Agents,
    CacheSpec,
    block_bytes,
    cancel,
    expect,
    make_cache,
    read_cache,
    send,
    wait,
)

import kvtransfer.staging
from kvtransfer import KVCancelledError, KVLayout, create_agent
from kvtransfer.staging import staging_setting, ucx_cuda_missing

TIMEOUT_S = 10.0
# Smaller than a block (737,280 bytes at fp32) and not a divisor of one: every run of blocks
# crosses chunk boundaries mid-block.
CHUNK_BYTES = 300_001
_request_ids = (f"staged-{i}" for i in itertools.count())


def create_staged(agents: Agents, key: str, backend: str, staged: bool, seed: int) -> bytes:
    kvtransfer.staging.CHUNK_BYTES = CHUNK_BYTES  # this host process's tcp bounce buffers
    cache = make_cache(CacheSpec("float32"), seed)
    staging = "always" if staged else "auto"
    agents[key] = create_agent(backend, key, cache, KVLayout.of(MODEL_ID, cache), staging=staging)
    assert agents[key].is_staged is staged
    return agents[key].metadata()


@pytest.fixture(scope="module", params=["nixl", "tcp"])
def hosts(request: pytest.FixtureRequest) -> Iterator[tuple[str, AgentHost, AgentHost]]:
    receiver, sender = AgentHost(), AgentHost()
    yield request.param, receiver, sender
    receiver.stop()
    sender.stop()


@pytest.mark.parametrize(("rx_staged", "tx_staged"), [(True, True), (False, True), (True, False)])
def test_staged_blocks_land_byte_for_byte(hosts, rx_staged: bool, tx_staged: bool) -> None:
    backend, receiver, sender = hosts
    rx, tx = f"rx-{rx_staged}-{tx_staged}", f"tx-{rx_staged}-{tx_staged}"
    rx_metadata = receiver.call(create_staged, rx, backend, rx_staged, 1)
    sender.call(create_staged, tx, backend, tx_staged, 2)
    src_ids, dst_ids = [0, 1, 2, 5, 7], [9, 3, 4, 0, 11]
    before = block_bytes(receiver.call(read_cache, rx))
    source = block_bytes(sender.call(read_cache, tx))
    request_id = next(_request_ids)

    receiver.call(expect, rx, request_id, dst_ids)
    chunks = [(src_ids[:2], dst_ids[:2]), (src_ids[2:], dst_ids[2:])]
    sender.call(send, tx, rx_metadata, request_id, chunks, TIMEOUT_S)
    receiver.call(wait, rx, request_id, TIMEOUT_S)

    expected = before.clone()
    expected[dst_ids] = source[src_ids]
    assert torch.equal(block_bytes(receiver.call(read_cache, rx)), expected)


def test_a_cancelled_staged_request_takes_no_late_data(hosts) -> None:
    backend, receiver, sender = hosts
    rx_metadata = receiver.call(create_staged, "rx-cancel", backend, True, 3)
    sender.call(create_staged, "tx-cancel", backend, True, 4)
    before = block_bytes(receiver.call(read_cache, "rx-cancel"))
    request_id = next(_request_ids)

    receiver.call(expect, "rx-cancel", request_id, [6, 8])
    receiver.call(cancel, "rx-cancel", request_id)
    with pytest.raises(KVCancelledError):
        sender.call(send, "tx-cancel", rx_metadata, request_id, [([0, 1], [6, 8])], TIMEOUT_S)

    assert torch.equal(block_bytes(receiver.call(read_cache, "rx-cancel")), before)


def _driver_loads() -> bool:
    try:
        ctypes.CDLL("libcuda.so.1")
        ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        return False
    return True


@pytest.mark.parametrize(
    ("ucx_tls", "reason"),
    [
        ("rc,tcp", "UCX_TLS=rc,tcp names no CUDA transport (cuda_copy, cuda_ipc, gdr_copy)"),
        ("^cuda_copy,tcp", "UCX_TLS=^cuda_copy,tcp excludes cuda_copy"),
        ("tcp,^cuda", "UCX_TLS=tcp,^cuda names no CUDA transport (cuda_copy, cuda_ipc, gdr_copy)"),
    ],
)
def test_ucx_without_a_cuda_transport_is_told_apart(ucx_tls: str, reason: str) -> None:
    assert ucx_cuda_missing({"UCX_TLS": ucx_tls}) == reason


def test_ucx_with_cuda_transports_needs_the_driver_libraries() -> None:
    for environ in ({"UCX_TLS": "rc,cuda_copy,cuda_ipc"}, {"UCX_TLS": "^tcp"}, {}):
        reason = ucx_cuda_missing(environ)
        if _driver_loads():
            assert reason is None
        else:  # this machine: no NVIDIA driver
            assert reason is not None and reason.startswith("libcuda.so.1 does not load")


def test_staging_setting_is_validated() -> None:
    assert staging_setting({}) == "auto"
    assert staging_setting({"PDSERVE_KV_STAGING": "always"}) == "always"
    with pytest.raises(ValueError, match="^PDSERVE_KV_STAGING must be auto, always or never"):
        staging_setting({"PDSERVE_KV_STAGING": "sometimes"})
