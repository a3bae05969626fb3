"""The planning loop: each interval, observe the load, predict the next interval's, size both
pools for the TTFT and ITL targets, apply the limits, and ask the connector for the counts."""

from __future__ import annotations

import json
import logging
import time

from planner.connector import Connector, ConnectorError, LoadSource, Observation
from planner.decision import Decision, Load
from planner.metrics import PlannerMetrics
from planner.predictors import make_predictor
from planner.profile import Profile
from planner.settings import POOLS, PlannerSettings, PoolName
from planner.sizing import (
    after_cooldown,
    decode_context_tokens,
    decode_replicas,
    prefill_replicas,
    within_bounds,
    within_budget,
)

log = logging.getLogger("pdserve.planner")
QUANTITIES = ("request_rate", "prompt_tokens", "output_tokens")


class Planner:
    def __init__(self, settings: PlannerSettings, profile: Profile, source: LoadSource,
                 connector: Connector, metrics: PlannerMetrics | None = None) -> None:  # fmt: skip
        self.settings = settings
        self.profile = profile
        self.source = source
        self.connector = connector
        self.metrics = metrics
        self.predictors = {q: make_predictor(settings.predictor, settings) for q in QUANTITIES}
        self.corrections: dict[PoolName, float] = {"prefill": 1.0, "decode": 1.0}
        self.changed_at_s: dict[PoolName, float] = {"prefill": -float("inf"),
                                                    "decode": -float("inf")}  # fmt: skip
        self.decisions: list[Decision] = []

    def step(self, now_s: float) -> Decision:
        """One interval: observe, decide, scale."""
        observation = self.source.observe()
        decision = self.decide(observation, self.connector.replicas(), now_s)
        for pool in POOLS:
            if decision.desired[pool] != decision.actual[pool]:
                self.connector.set_replicas(pool, decision.desired[pool])
                self.changed_at_s[pool] = now_s
        self.decisions.append(decision)
        log.info("planner decision %s", json.dumps(decision.as_dict()))
        if self.metrics is not None:
            self.metrics.record(decision)
        return decision

    def run_forever(self) -> None:
        while True:
            started = time.monotonic()
            try:
                self.step(started)
            except ConnectorError as e:  # the next interval reads and writes afresh
                log.error("planner interval skipped: %s", e)
            time.sleep(max(0.0, self.settings.interval_s - (time.monotonic() - started)))

    def decide(self, obs: Observation, actual: dict[PoolName, int], now_s: float) -> Decision:
        observed: Load = {"request_rate": obs.request_rate, "prompt_tokens": obs.prompt_tokens,
                          "output_tokens": obs.output_tokens}  # fmt: skip
        for quantity, value in observed.items():
            # An empty interval has no mean length: the lengths keep their last forecast.
            if quantity == "request_rate" or obs.num_requests:
                self.predictors[quantity].observe(value)
        predicted: Load = {q: self.predictors[q].predict() for q in QUANTITIES}
        expected_ttft, expected_itl = self._update_corrections(obs)
        s = self.settings
        formula: dict[PoolName, int] = {
            "prefill": prefill_replicas(predicted["request_rate"], predicted["prompt_tokens"],
                                        self.corrections["prefill"],
                                        s.prefill_utilization_target, self.profile),
            "decode": decode_replicas(predicted["request_rate"], predicted["prompt_tokens"],
                                      predicted["output_tokens"], self.corrections["decode"],
                                      s.itl_target_s, self.profile),
        }  # fmt: skip
        since = {pool: now_s - self.changed_at_s[pool] for pool in POOLS}
        bounded = within_bounds(formula, s)
        cooled = after_cooldown(bounded, actual, since, s)
        desired = within_budget(cooled, s)
        limited_by = tuple(name for name, before, after in (
            ("bounds", formula, bounded), ("cooldown", bounded, cooled),
            ("gpu_budget", cooled, desired)) if before != after)  # fmt: skip
        return Decision(
            time_s=now_s, predictor=s.predictor, observed=observed, predicted=predicted,
            ttft_s=obs.ttft_s, itl_s=obs.itl_s, expected_ttft_s=expected_ttft,
            expected_itl_s=expected_itl, corrections=dict(self.corrections), formula=formula,
            desired=desired, actual=dict(actual), limited_by=limited_by,
            slo_attainment=obs.slo_attainment,
        )  # fmt: skip

    def _update_corrections(self, obs: Observation) -> tuple[float | None, float | None]:
        """Observed / expected at the observed load; an interval without the latency keeps the
        last correction. Returns the expectations."""
        if not obs.num_requests:
            return None, None
        expected_ttft = self.profile.prefill.ttft_s(obs.prompt_tokens)
        context = decode_context_tokens(obs.prompt_tokens, obs.output_tokens)
        expected_itl = self.profile.decode.itl(obs.decode_batch_per_worker, context)
        # A zero mean is no measurement (and a zero correction would divide the ITL target).
        if obs.ttft_s:
            self.corrections["prefill"] = obs.ttft_s / expected_ttft
        if obs.itl_s:
            self.corrections["decode"] = obs.itl_s / expected_itl
        return expected_ttft, expected_itl
