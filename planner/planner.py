"""The planning loop: each interval, observe the load, predict the next interval's, size both
pools for the TTFT and ITL targets, apply the limits, and ask the connector for the counts."""

from __future__ import annotations

import json
import logging
import time

from planner.connector import Connector, ConnectorError, LoadSource, Observation
from planner.decision import BacklogScaleUp, Decision, Load
from planner.metrics import PlannerMetrics
from planner.predictors import make_predictor
from planner.profile import Profile
from planner.settings import POOLS, PlannerSettings, PoolName
from planner.sizing import (
    after_cooldown,
    backlog_tokens,
    decode_context_tokens,
    decode_replicas,
    prefill_replicas,
    prefill_workers,
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
        self.backlog_scale_ups: list[BacklogScaleUp] = []

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

    def check_backlog(self, now_s: float) -> BacklogScaleUp | None:
        """Between decisions: when the queued prompt tokens exceed what the prefill pool
        computes within the TTFT target, grow the pool at once to carry the prompt tokens/s
        arriving and drain that backlog within backlog_drain_s (the interval formula, with the
        measured arrivals in place of the forecast). It never shrinks a pool and leaves decode
        as it is; the next decision sizes both as usual (a shrink waits for the cooldown)."""
        flow = self.source.prefill_flow()
        if flow is None or flow.queued_prompt_tokens <= 0:  # no backlog: no replicas read
            return None
        s = self.settings
        actual = self.connector.replicas()
        # The queued prompts' speed at the last interval's mean length: measured, where a
        # forecast's trend may run far past it.
        prompt_tokens = self.decisions[-1].observed["prompt_tokens"] if self.decisions else 0.0
        backlog = backlog_tokens(flow.queued_prompt_tokens, actual["prefill"], prompt_tokens,
                                 s.ttft_target_s, self.profile)  # fmt: skip
        if backlog <= 0:
            return None
        formula = prefill_workers(flow.arriving_tokens_per_s, backlog / s.drain_s, prompt_tokens,
                                  s.prefill_utilization_target, self.profile)  # fmt: skip
        # Decode keeps its count, so prefill may have what the budget leaves it.
        room = (s.gpu_budget - actual["decode"] * s.gpus_per_decode) // s.gpus_per_prefill
        limits = (("bounds", s.max_prefill), ("gpu_budget", room))
        prefill = min(formula, s.max_prefill, room)
        since_s = now_s - self.changed_at_s["prefill"]
        if prefill <= actual["prefill"] or since_s < s.scale_up_cooldown_s:
            return None
        scale_up = BacklogScaleUp(
            time_s=now_s, queued_prompt_tokens=flow.queued_prompt_tokens, backlog_tokens=backlog,
            arriving_tokens_per_s=flow.arriving_tokens_per_s, prompt_tokens=prompt_tokens,
            formula=formula, desired={"prefill": prefill, "decode": actual["decode"]},
            actual=dict(actual),
            limited_by=tuple(name for name, cap in limits if cap < formula),
        )  # fmt: skip
        self.connector.set_replicas("prefill", prefill)
        self.changed_at_s["prefill"] = now_s
        self.backlog_scale_ups.append(scale_up)
        log.info("planner backlog scale-up %s", json.dumps(scale_up.as_dict()))
        if self.metrics is not None:
            self.metrics.record_backlog_scale_up(scale_up)
        return scale_up

    def run_forever(self) -> None:
        s = self.settings
        while True:
            started = time.monotonic()
            try:
                self.step(started)
            except ConnectorError as e:  # the next interval reads and writes afresh
                log.error("planner interval skipped: %s", e)
            next_s = started + s.interval_s
            while s.backlog_check_s and time.monotonic() + s.backlog_check_s < next_s:
                time.sleep(s.backlog_check_s)
                try:
                    self.check_backlog(time.monotonic())
                except ConnectorError as e:
                    log.error("planner backlog check skipped: %s", e)
            time.sleep(max(0.0, next_s - time.monotonic()))

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
        backlog = backlog_tokens(obs.queued_prompt_tokens, actual["prefill"],
                                 predicted["prompt_tokens"], s.ttft_target_s,
                                 self.profile)  # fmt: skip
        formula: dict[PoolName, int] = {
            "prefill": prefill_replicas(predicted["request_rate"], predicted["prompt_tokens"],
                                        self.corrections["prefill"],
                                        s.prefill_utilization_target, self.profile,
                                        drain_tokens_per_s=backlog / s.drain_s),
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
            slo_attainment=obs.slo_attainment, queued_prompt_tokens=obs.queued_prompt_tokens,
            backlog_tokens=backlog,
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
