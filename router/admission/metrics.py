"""Admission's own metrics: the queue wait it predicted for each request beside the wait that
request then had (router/metrics.py's pdserve_router_queue_wait_seconds), both observed when the
request leaves the queue, so per bucket the two histograms' sums and counts compare directly;
likewise the TTFT it predicted beside pdserve_router_ttft_seconds, at the first token."""

from prometheus_client import Gauge, Histogram

_WAIT_S = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
# Signed: observed minus predicted (positive: the estimate was too optimistic).
_ERROR_S = (-60, -30, -10, -5, -2.5, -1, -0.5, -0.1, 0.1, 0.5, 1, 2.5, 5, 10, 30, 60)

QUEUE_WAIT_PREDICTED = Histogram(
    "pdserve_router_queue_wait_predicted_seconds",
    "The router queue wait admission predicted at arrival, for requests that were dispatched",
    ["length_bucket"], buckets=_WAIT_S,
)  # fmt: skip
QUEUE_WAIT_ERROR = Histogram(
    "pdserve_router_queue_wait_prediction_error_seconds",
    "Observed minus predicted router queue wait, per dispatched request",
    ["length_bucket"], buckets=_ERROR_S,
)  # fmt: skip
TTFT_PREDICTED = Histogram(
    "pdserve_router_ttft_predicted_seconds",
    "The time to first token admission predicted at arrival (with the correction it had then), "
    "observed at the request's first token",
    ["length_bucket"], buckets=_WAIT_S,
)  # fmt: skip
TTFT_CORRECTION = Gauge(
    "pdserve_router_ttft_correction",
    "Observed / modelled time to first token that admission has learned, per pool",
    ["pool"],
)
TTFT_TAIL_MARGIN = Gauge(
    "pdserve_router_ttft_tail_margin",
    "How far the recent observed / modelled TTFTs' 99th percentile is over the correction, per "
    "pool: admission sheds by the corrected prediction times this",
    ["pool"],
)
