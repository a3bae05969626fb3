"""The router's Prometheus metrics: latency per length bucket and per worker, the TTFT
decomposition, queue wait and depth, rejections by reason, migrations."""

from typing import TypeVar

from prometheus_client import Counter, Gauge, Histogram
from prometheus_client.metrics import MetricWrapperBase

M = TypeVar("M", bound=MetricWrapperBase)

_LATENCY_S = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
_ITL_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)

REQUESTS = Counter(
    "pdserve_router_requests_total", "Requests by API and outcome", ["api", "outcome"]
)
REJECTIONS = Counter(
    "pdserve_router_rejections_total", "Requests rejected by backpressure",
    ["reason", "length_bucket"],
)  # fmt: skip
QUEUE_WAIT = Histogram(
    "pdserve_router_queue_wait_seconds", "Time in the router's admission queue",
    ["length_bucket"], buckets=_LATENCY_S,
)  # fmt: skip
QUEUE_DEPTH = Gauge("pdserve_router_queue_depth", "Requests waiting", ["length_bucket"])
# With the prefill workers' pdserve_prefill_queued_tokens, the prefill backlog the planner reads.
QUEUED_PROMPT_TOKENS = Gauge(
    "pdserve_router_queued_prompt_tokens", "Prompt tokens of the requests waiting in the queue"
)
ROUTED = Counter("pdserve_router_routed_total", "Requests sent to a worker", ["role", "worker"])
TTFT = Histogram(
    "pdserve_router_ttft_seconds", "Arrival at the router to the first token leaving it",
    ["length_bucket", "prefill_worker"], buckets=_LATENCY_S,
)  # fmt: skip
TTFT_PART = Histogram(
    "pdserve_router_ttft_part_seconds",
    "TTFT by part: tokenize, router_queue, prefill_queue, prefill_compute, kv_transfer, "
    "first_token_emit", ["part", "length_bucket"], buckets=_LATENCY_S,
)  # fmt: skip
INTER_TOKEN = Histogram(
    "pdserve_router_inter_token_latency_seconds", "Time between streamed tokens",
    ["decode_worker"], buckets=_ITL_S,
)  # fmt: skip
E2E = Histogram(
    "pdserve_router_e2e_latency_seconds", "Arrival to the last token",
    ["length_bucket"], buckets=_LATENCY_S,
)  # fmt: skip
DECODE_REFUSALS = Counter(
    "pdserve_router_decode_refusals_total",
    "Requests a decode worker refused before starting (past its limits), sent to another one",
    ["decode_worker"],
)
MIGRATIONS = Counter(
    "pdserve_router_migrations_total",
    "Requests moved to another decode worker after theirs was lost mid-request",
    ["decode_worker"],
)
PREFIX_OVERLAP = Histogram(
    "pdserve_router_prefix_overlap_tokens",
    "Prompt tokens the chosen worker's prefix cache already holds (prefill: not computed; "
    "decode: KV not sent)", ["role"],
    buckets=(0, 16, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384),
)  # fmt: skip
KV_EVENTS = Counter(
    "pdserve_router_kv_events_total",
    "Prefix-cache block events read from the workers' streams",
    ["event"],
)
KV_EVENT_RESYNCS = Counter(
    "pdserve_router_kv_event_resyncs_total",
    "Workers' prefix-cache streams read afresh after a gap in their entry numbers",
)
REGISTRY_REFRESH_FAILURES = Counter(
    "pdserve_router_registry_refresh_failures_total",
    "Reads of the worker registry that failed (Redis down or unreachable): the router routes "
    "on its last snapshot meanwhile",
)
ROUTER_REPLICAS = Gauge(
    "pdserve_router_replicas", "Router replicas this router hears from, itself included"
)
REPLICA_SYNC_FAILURES = Counter(
    "pdserve_router_replica_sync_failures_total",
    "Failed attempts to publish this router's assignments or to follow the other routers'",
    ["direction"],
)


# Children by (metric, label values). labels() converts and checks its values and takes the
# metric's lock on every call, several times per request; a child, once made, stays (a
# worker's too, as prometheus-client keeps it), so a lookup here is all later calls cost.
_children: dict[tuple[MetricWrapperBase, tuple[str, ...]], MetricWrapperBase] = {}


def child(metric: M, *label_values: str) -> M:
    """metric.labels(*label_values), looked up once."""
    key = (metric, label_values)
    found = _children.get(key)
    if found is None:
        found = _children[key] = metric.labels(*label_values)
    return found  # type: ignore[return-value]
