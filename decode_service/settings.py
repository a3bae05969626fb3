"""The decode worker's own settings (torch-free: the CLI reads their defaults at import)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class DecodeSettings:
    # The prefill phase's budget, every attempt and the KV landing included, within the
    # request's own gRPC deadline.
    prefill_timeout_s: float = 60.0
    max_prefill_attempts: int = 2  # the router's pick, then one other prefill worker
    local_prefill_fallback: bool = False  # prefill here when no prefill worker succeeds
    aggregated: bool = False  # prefill every request here (role "aggregated" in the registry)
