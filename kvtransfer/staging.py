"""Host staging for a KV cache in GPU memory: where a transport moves host bytes only (TCP, or
UCX without a CUDA transport), blocks are copied through pinned host buffers on a side stream.

Ordering: a send is requested on the engine thread right after the step that wrote its blocks;
ready_event() records an event on that thread's stream there, and every staging copy first
waits for it on the GPU, so a block is never read before the kernels writing it are done.
The same code runs over a CPU cache (plain copies, no events) when staging is forced: that is
how the CPU tests exercise it.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
from collections.abc import Iterator, Mapping, Sequence
from typing import Literal

import torch

from kvtransfer.blocks import runs

CHUNK_BYTES = 8 << 20  # one bounce buffer of the tcp backend (two per connection and side)

# NIXL's choice for a CUDA cache: auto registers the GPU memory itself when UCX can move it,
# else stages; always stages (also over a CPU cache: the tests); never fails instead.
Staging = Literal["auto", "always", "never"]
STAGING_ENV = "PDSERVE_KV_STAGING"
# UCX transports that move GPU memory (cuda_copy: host<->GPU and RDMA pipelines; cuda_ipc: GPU to
# GPU on one host; gdr_copy: GPUDirect RDMA copies); "cuda" and "all" stand for them.
_UCX_CUDA_TRANSPORTS = ("cuda", "cuda_copy", "cuda_ipc", "gdr_copy", "all")
# The bundled UCX's CUDA module links these (the NVIDIA driver's libraries): without them UCX
# loads no CUDA transport at all.
_UCX_CUDA_LIBRARIES = ("libcuda.so.1", "libnvidia-ml.so.1")


def ucx_cuda_missing(environ: Mapping[str, str] = os.environ) -> str | None:
    """Why UCX cannot move GPU memory here, or None when it can (as far as can be told before
    registering: the registration itself is the last check)."""
    tls = environ.get("UCX_TLS", "").strip()
    names = [t.strip() for t in tls.split(",") if t.strip()]
    if names and names[0].startswith("^"):
        excluded = {names[0][1:], *names[1:]}
        if {"cuda", "cuda_copy"} & excluded:
            return f"UCX_TLS={tls} excludes cuda_copy"
    elif names and not any(n in _UCX_CUDA_TRANSPORTS for n in names):
        return f"UCX_TLS={tls} names no CUDA transport (cuda_copy, cuda_ipc, gdr_copy)"
    for library in _UCX_CUDA_LIBRARIES:
        try:
            ctypes.CDLL(library)
        except OSError as e:
            return f"{library} does not load, so UCX has no CUDA transport ({e})"
    return None


def staging_setting(environ: Mapping[str, str] = os.environ) -> Staging:
    value = environ.get(STAGING_ENV, "auto")
    if value not in ("auto", "always", "never"):
        raise ValueError(f"{STAGING_ENV} must be auto, always or never, got {value!r}")
    return value  # type: ignore[return-value]


def ready_event(kv_cache: torch.Tensor) -> torch.cuda.Event | None:
    """An event that completes once every kernel queued so far on this thread's stream is done
    (None for a CPU cache, whose writes are done when the step returns)."""
    if not kv_cache.is_cuda:
        return None
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(kv_cache.device))
    return event


def host_buffer(num_bytes: int, like: torch.Tensor) -> torch.Tensor:
    """A uint8 host buffer, pinned when the cache is on a GPU (DMA copies, and registrable)."""
    return torch.empty(num_bytes, dtype=torch.uint8, pin_memory=like.is_cuda)


class DeviceBytes:
    """Byte-range copies between the cache and host buffers, on a stream of their own."""

    def __init__(self, kv_cache: torch.Tensor) -> None:
        self.bytes = kv_cache.view(-1).view(torch.uint8)
        self.is_cuda = kv_cache.is_cuda
        self.stream = torch.cuda.Stream(kv_cache.device) if self.is_cuda else None

    def _on_stream(self):
        return (
            torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext()
        )

    def to_host(
        self, dst: torch.Tensor, start: int, after: torch.cuda.Event | None = None
    ) -> torch.cuda.Event | None:
        """Starts copying cache bytes [start, start + len(dst)) into dst; returns the event that
        marks the copy done (None: already done)."""
        with self._on_stream():
            if after is not None:
                self.stream.wait_event(after)
            dst.copy_(self.bytes[start : start + dst.numel()], non_blocking=True)
            return self._record()

    def from_host(self, src: torch.Tensor, start: int) -> None:
        """Copies src into cache bytes [start, start + len(src)); returns once they are there."""
        with self._on_stream():
            self.bytes[start : start + src.numel()].copy_(src, non_blocking=True)
        if self.stream is not None:
            self.stream.synchronize()

    def _record(self) -> torch.cuda.Event | None:
        if self.stream is None:
            return None
        event = torch.cuda.Event()
        event.record(self.stream)
        return event


class StagedReader:
    """Sender side of the tcp backend: a byte range of the cache as host chunks, two pinned
    buffers in turn, so the copy of chunk i+1 runs while chunk i is on the wire."""

    def __init__(self, kv_cache: torch.Tensor, chunk_bytes: int | None = None) -> None:
        chunk_bytes = chunk_bytes or CHUNK_BYTES
        self._device = DeviceBytes(kv_cache)
        self._buffers = [host_buffer(chunk_bytes, kv_cache) for _ in range(2)]
        self._views = [memoryview(b.numpy()) for b in self._buffers]
        self.chunk_bytes = chunk_bytes

    def chunks(
        self, start: int, length: int, after: torch.cuda.Event | None
    ) -> Iterator[memoryview]:
        """Host views of cache bytes [start, start + length), in order; each is valid until
        the next one is asked for."""
        bounds = [
            (offset, min(self.chunk_bytes, length - offset))
            for offset in range(0, length, self.chunk_bytes)
        ]
        pending = None
        for i, (offset, n) in enumerate(bounds):
            if pending is None:
                pending = self._copy(i, start + offset, n, after)
            done, pending = pending, None
            if i + 1 < len(bounds):
                next_offset, next_n = bounds[i + 1]
                pending = self._copy(i + 1, start + next_offset, next_n, after)
            if done is not None:
                done.synchronize()
            yield self._views[i % 2][:n]

    def _copy(self, i: int, start: int, n: int, after: torch.cuda.Event | None):
        return self._device.to_host(self._buffers[i % 2][:n], start, after)


class StagedWriter:
    """Receiver side of the tcp backend: bytes arrive in a pinned chunk, then go to the cache."""

    def __init__(self, kv_cache: torch.Tensor, chunk_bytes: int | None = None) -> None:
        chunk_bytes = chunk_bytes or CHUNK_BYTES  # read at call time: tests shrink it
        self._device = DeviceBytes(kv_cache)
        self.buffer = host_buffer(chunk_bytes, kv_cache)
        self.view = memoryview(self.buffer.numpy())

    def flush(self, num_bytes: int, start: int) -> None:
        """The chunk's first num_bytes belong at cache byte start: copy them there, now."""
        self._device.from_host(self.buffer[:num_bytes], start)


class BlockMirror:
    """A host copy of the whole cache, block for block (NIXL without a CUDA transport): the
    agent registers it instead of GPU memory, and blocks move between it and the GPU."""

    def __init__(self, kv_cache: torch.Tensor) -> None:
        self.blocks = torch.empty(kv_cache.shape, dtype=kv_cache.dtype, pin_memory=kv_cache.is_cuda)
        self._device = DeviceBytes(kv_cache)
        self._host = self.blocks.view(-1).view(torch.uint8)
        self._bytes_per_block = kv_cache[0].numel() * kv_cache.element_size()

    def copy_out(
        self, block_ids: Sequence[int], after: torch.cuda.Event | None
    ) -> torch.cuda.Event | None:
        """Starts copying these GPU blocks into the mirror; the event marks them all there."""
        event = None
        bpb = self._bytes_per_block
        for first, count in runs(block_ids):
            dst = self._host[first * bpb : (first + count) * bpb]
            event = self._device.to_host(dst, first * bpb, after)
        return event

    def copy_in(self, block_ids: Sequence[int]) -> None:
        """Copies these mirror blocks into the GPU cache; returns once they are there."""
        bpb = self._bytes_per_block
        for first, count in runs(block_ids):
            self._device.from_host(self._host[first * bpb : (first + count) * bpb], first * bpb)
