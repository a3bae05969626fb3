"""Prometheus metrics of KV transfers, defined once for every backend."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

KV_TRANSFER_BYTES = Counter(
    "pdserve_kv_transfer_bytes_total",
    "KV cache bytes moved between workers.",
    ["backend", "direction"],  # direction: sent | received
)

# One observation per send(): from the call until the receiver holds every byte of it.
KV_TRANSFER_SECONDS = Histogram(
    "pdserve_kv_transfer_seconds",
    "Latency of one KV send, from the call until the blocks have landed on the receiver.",
    ["backend"],
    buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0),
)

# What an agent moves bytes from and into: DRAM or VRAM in place, or "staged" (a CUDA cache
# through pinned host buffers, where the transport cannot move GPU memory).
KV_TRANSFER_MEMORY = Gauge(
    "pdserve_kv_transfer_memory_info",
    "Memory the KV transfer agent reads and writes (1).",
    ["backend", "memory"],
)
