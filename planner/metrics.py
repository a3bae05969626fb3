"""The planner's Prometheus metrics: desired vs actual replicas per pool, predicted vs observed
load, the corrections and SLO attainment. One set per registry (the simulator runs several
planners in one process)."""

from __future__ import annotations

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge

from planner.decision import BacklogScaleUp, Decision


class PlannerMetrics:
    def __init__(self, registry: CollectorRegistry = REGISTRY) -> None:
        self.replicas = Gauge(
            "pdserve_planner_replicas", "Replicas per pool: desired (decided) or actual",
            ["pool", "kind"], registry=registry,
        )  # fmt: skip
        self.load = Gauge(
            "pdserve_planner_load",
            "Load per quantity (request_rate in req/s, prompt_tokens, output_tokens): predicted "
            "for the next interval or observed in the last", ["quantity", "kind"],
            registry=registry,
        )  # fmt: skip
        self.correction = Gauge(
            "pdserve_planner_correction",
            "Observed / expected latency per pool (TTFT for prefill, ITL for decode)", ["pool"],
            registry=registry,
        )  # fmt: skip
        self.slo_attainment = Gauge(
            "pdserve_planner_slo_attainment",
            "Fraction of the last interval's finished requests within both the TTFT and ITL "
            "targets", registry=registry,
        )  # fmt: skip
        self.decisions = Counter(
            "pdserve_planner_decisions_total", "Decisions, by whether they changed a pool",
            ["changed"], registry=registry,
        )  # fmt: skip
        self.queued_prompt_tokens = Gauge(
            "pdserve_planner_queued_prompt_tokens",
            "Prompt tokens queued for prefill as the planner last read them (router queues and "
            "prefill workers), and the backlog beyond what the pool prefills within the TTFT "
            "target", ["kind"], registry=registry,
        )  # fmt: skip
        self.backlog_scale_ups = Counter(
            "pdserve_planner_backlog_scale_ups_total",
            "Prefill scale-ups between decisions, on a backlog past the TTFT target's worth",
            registry=registry,
        )  # fmt: skip

    def record(self, decision: Decision) -> None:
        for pool in ("prefill", "decode"):
            self.replicas.labels(pool, "desired").set(decision.desired[pool])
            self.replicas.labels(pool, "actual").set(decision.actual[pool])
            self.correction.labels(pool).set(decision.corrections[pool])
        for quantity, value in decision.predicted.items():
            self.load.labels(quantity, "predicted").set(value)
        for quantity, value in decision.observed.items():
            self.load.labels(quantity, "observed").set(value)
        self.queued_prompt_tokens.labels("queued").set(decision.queued_prompt_tokens)
        self.queued_prompt_tokens.labels("backlog").set(decision.backlog_tokens)
        if decision.slo_attainment is not None:
            self.slo_attainment.set(decision.slo_attainment)
        self.decisions.labels(str(decision.desired != decision.actual).lower()).inc()

    def record_backlog_scale_up(self, scale_up: BacklogScaleUp) -> None:
        self.replicas.labels("prefill", "desired").set(scale_up.desired["prefill"])
        self.replicas.labels("prefill", "actual").set(scale_up.actual["prefill"])
        self.queued_prompt_tokens.labels("queued").set(scale_up.queued_prompt_tokens)
        self.queued_prompt_tokens.labels("backlog").set(scale_up.backlog_tokens)
        self.backlog_scale_ups.inc()
