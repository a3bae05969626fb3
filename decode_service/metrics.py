"""Prometheus metrics of the decode worker."""

from prometheus_client import Counter, Histogram

PREFILL_SECONDS = Histogram(
    "pdserve_decode_remote_prefill_seconds",
    "Prefill RPC plus KV landing, as the decode worker waits for it", ["length_bucket"],
    buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
)  # fmt: skip
PREFILL_ATTEMPTS = Counter(
    "pdserve_decode_prefill_attempts_total", "Prefill attempts by outcome", ["outcome"]
)
REQUESTS = Counter("pdserve_decode_requests_total", "Generate requests by outcome", ["outcome"])
# The SLA planner's output-length signal (prompt tokens: pdserve_prefill_prompt_tokens_total).
OUTPUT_TOKENS = Counter("pdserve_decode_output_tokens_total", "Tokens streamed, every sample's")
