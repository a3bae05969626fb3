"""Agent host processes for the kvtransfer tests: each owns real agents, driven over a pipe."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import torch
from prometheus_client import REGISTRY

from engine import kv_quant
from kvtransfer import Backend, KVAgent, KVLayout, KVTransferError, create_agent

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "int8": torch.int8}
MODEL_ID = "SmolLM2-135M-Instruct"
CALL_TIMEOUT_S = 60.0


@dataclass(frozen=True, slots=True)
class CacheSpec:
    """A paged KV cache with SmolLM2-135M's per-block shape (30 layers, 3 KV heads, dim 64)."""

    dtype: str
    block_size: int = 16
    num_blocks: int = 12
    num_layers: int = 30
    num_kv_heads: int = 3
    head_dim: int = 64


def make_cache(spec: CacheSpec, seed: int) -> torch.Tensor:
    """Random bytes (not random floats): every bit pattern must survive the trip, NaNs included."""
    width = kv_quant.row_width(spec.head_dim, quantized=spec.dtype == "int8")
    cache = torch.empty(
        (spec.num_blocks, spec.num_layers, 2, spec.block_size, spec.num_kv_heads, width),
        dtype=DTYPES[spec.dtype],
    )
    raw = cache.view(-1).view(torch.uint8)
    generator = torch.Generator().manual_seed(seed)
    raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=generator))
    return cache


def block_bytes(cache: torch.Tensor) -> torch.Tensor:
    """[num_blocks, bytes_per_block] uint8 view, for exact comparisons."""
    return cache.view(cache.shape[0], -1).view(torch.uint8)


# ---- commands, run inside the host process: fn(agents, *args)

Agents = dict[str, KVAgent]


def create(agents: Agents, key: str, backend: Backend, spec: CacheSpec, seed: int) -> bytes:
    cache = make_cache(spec, seed)
    agents[key] = create_agent(backend, key, cache, KVLayout.of(MODEL_ID, cache))
    return agents[key].metadata()


def backend_of(agents: Agents, key: str) -> str:
    return agents[key].backend


def expect(
    agents: Agents, key: str, request_id: str, block_ids: Sequence[int],
    readable_block_ids: Sequence[int] = (),
) -> None:  # fmt: skip
    agents[key].expect(request_id, block_ids, readable_block_ids)


def wait(agents: Agents, key: str, request_id: str, timeout_s: float) -> None:
    agents[key].wait(request_id, timeout_s)


def cancel(agents: Agents, key: str, request_id: str) -> None:
    agents[key].cancel(request_id)


def send(
    agents: Agents,
    key: str,
    peer_metadata: bytes,
    request_id: str,
    chunks: Sequence[tuple[Sequence[int], Sequence[int]]],
    timeout_s: float,
) -> None:
    """Every chunk is put in flight before any is waited for, as a pipelined prefill does."""
    handles = [agents[key].send(peer_metadata, request_id, src, dst) for src, dst in chunks]
    for handle in handles:
        handle.wait(timeout_s)


def read(
    agents: Agents, key: str, peer_metadata: bytes, request_id: str, src: Sequence[int],
    dst: Sequence[int], timeout_s: float,
) -> None:  # fmt: skip
    """A read as the prefill worker does it: a failed one is cancelled, fencing the holder."""
    handle = agents[key].read(peer_metadata, request_id, src, dst)
    try:
        handle.wait(timeout_s)
    except KVTransferError:
        assert agents[key].cancel(request_id).is_done()
        raise


def close(agents: Agents, key: str) -> None:
    agents[key].close()


def read_cache(agents: Agents, key: str) -> torch.Tensor:
    return agents[key].kv_cache.clone()


def bytes_sent(agents: Agents, backend: str, direction: str = "sent") -> float:
    labels = {"backend": backend, "direction": direction}
    return REGISTRY.get_sample_value("pdserve_kv_transfer_bytes_total", labels) or 0.0


# ---- the host process


def _serve(conn: Connection) -> None:
    agents: Agents = {}
    try:
        while (message := conn.recv()) is not None:
            fn, args = message
            try:
                conn.send(("ok", fn(agents, *args)))
            except Exception as e:  # handed to the test, which re-raises it
                conn.send(("raised", e))
    finally:
        for agent in agents.values():
            agent.close()
    # Skip interpreter teardown (seconds with torch loaded): everything worth closing is closed.
    os._exit(0)


class AgentHost:
    """A spawned process (never forked: NIXL agents must not be forked) hosting agents."""

    def __init__(self) -> None:
        context = mp.get_context("spawn")
        self._conn, child_conn = context.Pipe()
        self.process = context.Process(target=_serve, args=(child_conn,), daemon=True)
        self.process.start()

    def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        self._conn.send((fn, args))
        if not self._conn.poll(CALL_TIMEOUT_S):
            raise TimeoutError(f"{fn.__name__} did not return within {CALL_TIMEOUT_S} s")
        status, value = self._conn.recv()
        if status == "raised":
            raise value
        return value

    def kill(self) -> None:
        """SIGKILL: no close(), no goodbye on any socket or endpoint."""
        assert self.process.pid is not None
        os.kill(self.process.pid, signal.SIGKILL)
        self.process.join()

    def stop(self) -> None:
        if self.process.is_alive():
            self._conn.send(None)
            self.process.join(timeout=10)
        if self.process.is_alive():
            self.kill()
