"""Prometheus metrics of the prefill worker (per prompt-length bucket)."""

from prometheus_client import Counter, Gauge, Histogram

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
# Where each prompt token's KV came from: computed here, this worker's prefix cache, or read
# from the decode worker's (cross-worker prefix reuse); the three add up to the prompt tokens.
PROMPT_TOKENS = Counter(
    "pdserve_prefill_prompt_tokens_total", "Prompt tokens by the source of their KV", ["source"]
)
# ok | failed (computed after all) | slower (the transfer would take longer than the compute)
# | no_room (no KV blocks free within the watermark)
PEER_FETCHES = Counter(
    "pdserve_prefill_peer_fetches_total",
    "Reads of a prefix the decode worker holds, by outcome", ["outcome"],
)  # fmt: skip
PEER_FETCH_BYTES_PER_S = Gauge(
    "pdserve_prefill_peer_fetch_bytes_per_second",
    "Measured speed of prefix reads (a prior until one is measured): what decides a fetch",
)
