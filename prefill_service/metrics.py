"""Prometheus metrics of the prefill worker (per prompt-length bucket)."""

from prometheus_client import Counter, Histogram

_SECONDS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)

QUEUE_WAIT = Histogram(
    "pdserve_prefill_queue_wait_seconds", "Arrival to first scheduled chunk", ["length_bucket"],
    buckets=_SECONDS,
)  # fmt: skip
COMPUTE = Histogram(
    "pdserve_prefill_compute_seconds", "First chunk to first token", ["length_bucket"],
    buckets=_SECONDS,
)  # fmt: skip
TRANSFER_WAIT = Histogram(
    "pdserve_prefill_transfer_wait_seconds",
    "First token to the last KV byte acknowledged", ["length_bucket"], buckets=_SECONDS,
)  # fmt: skip
REQUESTS = Counter("pdserve_prefill_requests_total", "Prefill requests by outcome", ["outcome"])
