"""The KV tiers' metrics: prefix lookups per tier, bytes between the pool and the host tier,
load time and occupancy (torch-free: the KV cache manager counts its lookups here)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

TIER_LOOKUPS = Counter(
    "pdserve_kv_tier_lookups_total",
    "Prefix blocks looked up, by tier (pool, host) and result (hit, miss; skipped: held by the "
    "host tier but computed, as loading measured slower)",
    ["tier", "result"],
)
TIER_BYTES = Counter(
    "pdserve_kv_tier_bytes_total", "Bytes copied between the pool and the host tier",
    ["direction"],  # store: pool -> host; load: host -> pool
)  # fmt: skip
TIER_FAILED_LOADS = Counter(
    "pdserve_kv_tier_failed_loads_total",
    "Host-tier blocks refused on load (checksum or short read): computed instead",
)
TIER_LOAD_SECONDS = Histogram(
    "pdserve_kv_tier_load_seconds", "Time to copy one block from the host tier into the pool",
    buckets=(1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 0.1),
)  # fmt: skip
TIER_BLOCKS = Gauge("pdserve_kv_tier_blocks", "Host-tier blocks, by state", ["state"])
