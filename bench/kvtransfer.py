"""KV transfer bandwidth between two processes: NIXL vs TCP vs gRPC 4 MiB chunks vs local memcpy.

Prints a table, then one JSON line (the last line of stdout):
{"gbps": {backend: {"1MiB": x, ...}}, "nixl_vs_memcpy": {...}, "nixl_vs_grpc": {...}}
GB/s is 1e9 bytes per second over the median of the repeats. Every timed transfer ends when the
bytes are in the receiver's cache: a NIXL WRITE's remote completion, a tcp ack, a gRPC reply.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from multiprocessing import get_context
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

# This file shares its name with the package it measures: drop the script's own folder from the
# import path so that `import kvtransfer` finds the package, not this file.
_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]
sys.path.insert(0, str(_HERE.parent))
# Huge pages for torch's CPU allocations: without them torch buffers copy slower than numpy ones.
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

import grpc  # noqa: E402
import torch  # noqa: E402

from kvtransfer import KVAgent, KVLayout, create_agent  # noqa: E402
from pdserve.netns import Host  # noqa: E402

MiB = 1 << 20
SIZES_MIB = (1, 16, 64, 256)
REPEATS = {1: 30, 16: 15, 64: 8, 256: 4}
METHODS = ("nixl", "tcp", "grpc", "memcpy")
# 16 layers * (K, V) * 16 tokens * 8 heads * 64 dims * 4 bytes = 1 MiB per block.
LAYOUT = KVLayout("bench", "float32", 16, 16, 8, 64)
NUM_BLOCKS = max(SIZES_MIB) * MiB // LAYOUT.bytes_per_block
GRPC_CHUNK_BYTES = 4 * MiB
GRPC_METHOD = "/kvbench.Sink/Put"
TIMEOUT_S = 60.0


def _new_cache(fill: int) -> torch.Tensor:
    shape = (
        NUM_BLOCKS,
        LAYOUT.num_layers,
        2,
        LAYOUT.block_size,
        LAYOUT.num_kv_heads,
        LAYOUT.head_dim,
    )
    return torch.full(shape, float(fill), dtype=torch.float32)


class _Side:
    """What one bench process owns: an agent per backend, its cache, and (receiver) a gRPC sink.
    The tcp agent listens on address."""

    def __init__(self, fill: int, address: str = "127.0.0.1") -> None:
        self.agents: dict[str, KVAgent] = {}
        for backend in ("nixl", "tcp"):
            cache = _new_cache(fill)
            self.agents[backend] = create_agent(
                backend, f"bench-{backend}", cache, LAYOUT, host=address
            )
        self.grpc_sink = _new_cache(0).view(-1).view(torch.uint8).numpy()
        self.grpc_server: grpc.Server | None = None
        self.grpc_port = 0
        self.peer_metadata: dict[str, bytes] = {}
        self.grpc_channel: grpc.Channel | None = None
        self.grpc_put: grpc.StreamUnaryMultiCallable | None = None


# ---- commands run inside a bench process: fn(side, *args)


def start_receiver(side: _Side) -> tuple[dict[str, bytes], int]:
    sink = memoryview(side.grpc_sink)

    def put(chunks: Iterator[bytes], _context: grpc.ServicerContext) -> bytes:
        offset = 0
        for chunk in chunks:  # land each chunk in the cache, as a receiver must
            sink[offset : offset + len(chunk)] = chunk
            offset += len(chunk)
        return offset.to_bytes(8, "little")

    handler = grpc.method_handlers_generic_handler(
        "kvbench.Sink", {"Put": grpc.stream_unary_rpc_method_handler(put)}
    )
    options = [("grpc.max_receive_message_length", 2 * GRPC_CHUNK_BYTES)]
    side.grpc_server = grpc.server(futures.ThreadPoolExecutor(max_workers=2), options=options)
    side.grpc_server.add_generic_rpc_handlers((handler,))
    side.grpc_port = side.grpc_server.add_insecure_port("127.0.0.1:0")
    side.grpc_server.start()
    return {b: agent.metadata() for b, agent in side.agents.items()}, side.grpc_port


def expect(side: _Side, backend: str, request_id: str, num_blocks: int) -> None:
    side.agents[backend].expect(request_id, range(num_blocks))


def wait(side: _Side, backend: str, request_id: str) -> None:
    side.agents[backend].wait(request_id, TIMEOUT_S)


def connect(side: _Side, metadata: dict[str, bytes], grpc_port: int) -> None:
    side.peer_metadata = metadata
    options = [("grpc.max_send_message_length", 2 * GRPC_CHUNK_BYTES)]
    side.grpc_channel = grpc.insecure_channel(f"127.0.0.1:{grpc_port}", options=options)
    side.grpc_put = side.grpc_channel.stream_unary(GRPC_METHOD)


def timed_send(side: _Side, backend: str, request_id: str, num_blocks: int) -> float:
    ids = list(range(num_blocks))
    started = time.perf_counter()
    side.agents[backend].send(side.peer_metadata[backend], request_id, ids, ids).wait(TIMEOUT_S)
    return time.perf_counter() - started


def timed_grpc(side: _Side, num_bytes: int) -> float:
    source = memoryview(side.agents["tcp"].kv_cache.view(-1).view(torch.uint8).numpy())

    def chunks() -> Iterator[bytes]:
        for offset in range(0, num_bytes, GRPC_CHUNK_BYTES):
            yield bytes(source[offset : offset + GRPC_CHUNK_BYTES])  # grpc wants bytes

    started = time.perf_counter()
    side.grpc_put(chunks(), timeout=TIMEOUT_S)
    return time.perf_counter() - started


def timed_memcpy(side: _Side, num_bytes: int) -> float:
    source = side.agents["nixl"].kv_cache.view(-1).view(torch.uint8)[:num_bytes]
    target = side.agents["tcp"].kv_cache.view(-1).view(torch.uint8)[:num_bytes]
    started = time.perf_counter()
    target.copy_(source)
    return time.perf_counter() - started


def _serve(conn: Connection, fill: int, host: Host | None) -> None:
    if host is not None:  # before any agent exists: UCX reads its settings once
        host.enter()
        os.environ.update(host.environment)
    side = _Side(fill, host.address if host else "127.0.0.1")
    conn.send("ready")
    while (message := conn.recv()) is not None:
        fn, args = message
        conn.send(fn(side, *args))
    for agent in side.agents.values():
        agent.close()
    if side.grpc_channel is not None:
        side.grpc_channel.close()
    if side.grpc_server is not None:
        side.grpc_server.stop(grace=None)


class BenchProcess:
    """A bench process, on this machine's loopback or on a host of a pdserve.netns Network."""

    def __init__(self, fill: int, host: Host | None = None) -> None:
        context = get_context("spawn")  # never fork: NIXL agents live in these processes
        self._conn, child = context.Pipe()
        self._process = context.Process(target=_serve, args=(child, fill, host), daemon=True)
        self._process.start()

    def ready(self) -> None:
        assert self._conn.recv() == "ready"

    def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        self._conn.send((fn, args))
        return self._conn.recv()

    def stop(self) -> None:
        self._conn.send(None)
        self._process.join(timeout=30)


def gbps_of(num_bytes: int, seconds: list[float]) -> float:
    return round(num_bytes / statistics.median(seconds) / 1e9, 3)


def measure(
    receiver: BenchProcess, sender: BenchProcess, method: str, request_id: str, size_mib: int
) -> float:
    if method == "grpc":
        return sender.call(timed_grpc, size_mib * MiB)
    if method == "memcpy":
        return sender.call(timed_memcpy, size_mib * MiB)
    receiver.call(expect, method, request_id, size_mib)
    seconds = sender.call(timed_send, method, request_id, size_mib)
    receiver.call(wait, method, request_id)
    return seconds


def main() -> None:
    started = time.perf_counter()
    receiver, sender = BenchProcess(fill=0), BenchProcess(fill=1)
    receiver.ready()
    sender.ready()
    metadata, grpc_port = receiver.call(start_receiver)
    sender.call(connect, metadata, grpc_port)

    gbps: dict[str, dict[str, float]] = {method: {} for method in METHODS}
    for size_mib in SIZES_MIB:
        seconds: dict[str, list[float]] = {method: [] for method in METHODS}
        # Round-robin over the methods, so that load from other processes on this machine hits
        # them alike; the first round is a warm-up (connections, first touch).
        for round_index in range(REPEATS[size_mib] + 1):
            for method in METHODS:
                request_id = f"{method}-{size_mib}-{round_index}"
                elapsed = measure(receiver, sender, method, request_id, size_mib)
                if round_index > 0:
                    seconds[method].append(elapsed)
        for method in METHODS:
            gbps[method][f"{size_mib}MiB"] = gbps_of(size_mib * MiB, seconds[method])
    receiver.stop()
    sender.stop()

    sizes = [f"{s}MiB" for s in SIZES_MIB]
    result = {
        "gbps": gbps,
        "nixl_vs_memcpy": {s: round(gbps["nixl"][s] / gbps["memcpy"][s], 3) for s in sizes},
        "nixl_vs_grpc": {s: round(gbps["nixl"][s] / gbps["grpc"][s], 3) for s in sizes},
    }
    rows = {**gbps, "nixl/memcpy": result["nixl_vs_memcpy"], "nixl/grpc": result["nixl_vs_grpc"]}
    print(f"{'GB/s':>12}" + "".join(f"{s:>10}" for s in sizes))
    for name, row in rows.items():
        print(f"{name:>12}" + "".join(f"{row[s]:>10.3f}" for s in sizes))
    print(f"({time.perf_counter() - started:.1f} s, torch threads {torch.get_num_threads()})")
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
