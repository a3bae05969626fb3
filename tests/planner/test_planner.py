"""The loop: one observation in, one decision out (logged, exported, applied), with the
numbers worked out from the conftest profile."""

from __future__ import annotations

import json
import logging
from dataclasses import replace

import pytest
from prometheus_client import CollectorRegistry

from planner.connector import Connector, LoadSource, Observation, PrefillFlow
from planner.metrics import PlannerMetrics
from planner.planner import Planner
from planner.settings import PlannerSettings


class Script(LoadSource, Connector):
    """Hands out the observations given, and records what the planner asks for."""

    def __init__(self, observations: list[Observation], prefill: int, decode: int) -> None:
        self.observations = list(observations)
        self.flows: list[PrefillFlow] = []
        self.counts = {"prefill": prefill, "decode": decode}
        self.calls: list[tuple[str, int]] = []

    def observe(self) -> Observation:
        return self.observations.pop(0)

    def prefill_flow(self) -> PrefillFlow | None:
        return self.flows.pop(0) if self.flows else super().prefill_flow()

    def replicas(self):
        return dict(self.counts)

    def set_replicas(self, pool, count):
        self.calls.append((pool, count))
        self.counts[pool] = count


def interval(rate: float, ttft_s: float | None = 0.1, itl_s: float | None = 0.02,
             batch: float = 8.0) -> Observation:  # fmt: skip
    """60 s of 400-token prompts and 100-token outputs (decode context 450 -> the 512 row)."""
    return Observation(interval_s=60.0, num_requests=round(rate * 60), prompt_tokens=400.0,
                       output_tokens=100.0, ttft_s=ttft_s, itl_s=itl_s,
                       decode_batch_per_worker=batch, num_finished=100, num_met_slo=95)  # fmt: skip


def make(profile, observations, prefill=1, decode=1, **settings):
    s = PlannerSettings(predictor="constant", prefill_utilization_target=1.0, **settings)
    script = Script(observations, prefill, decode)
    registry = CollectorRegistry()
    return Planner(s, profile, script, script, PlannerMetrics(registry)), script, registry


def test_one_interval_sizes_both_pools(profile, caplog):
    # 20 req/s x 400 = 8,000 prompt tokens/s on 4,000/s workers -> 2 prefill; 2,000 output
    # tokens/s on 800/s workers -> 3 decode. TTFT and ITL as profiled: corrections 1.
    planner, script, _ = make(profile, [interval(20.0)])
    with caplog.at_level(logging.INFO, logger="pdserve.planner"):
        decision = planner.step(60.0)
    assert decision.formula == {"prefill": 2, "decode": 3}
    assert decision.desired == {"prefill": 2, "decode": 3}
    assert decision.actual == {"prefill": 1, "decode": 1}
    assert decision.corrections == {"prefill": 1.0, "decode": 1.0}
    assert (decision.expected_ttft_s, decision.expected_itl_s) == (0.1, 0.02)
    assert decision.predicted == {"request_rate": 20.0, "prompt_tokens": 400.0,
                                  "output_tokens": 100.0}  # fmt: skip
    assert decision.slo_attainment == 0.95
    assert decision.limited_by == ()
    assert script.calls == [("prefill", 2), ("decode", 3)]
    logged = json.loads(caplog.records[-1].getMessage().removeprefix("planner decision "))
    assert logged["desired"] == {"prefill": 2, "decode": 3}


def test_corrections_scale_the_counts(profile):
    # ITL 0.04 s where the profile expects 0.02 s: correction 2, target 25 ms -> 400/s per
    # worker (batch 8) -> 5 decode. TTFT twice the profile's: prefill still 2 (min(1, 2)).
    planner, _, _ = make(profile, [interval(20.0, ttft_s=0.2, itl_s=0.04)])
    decision = planner.step(60.0)
    assert decision.corrections == {"prefill": 2.0, "decode": 2.0}
    assert decision.formula == {"prefill": 2, "decode": 5}


def test_an_interval_without_latency_keeps_the_last_corrections(profile):
    planner, _, _ = make(profile, [interval(20.0, itl_s=0.04), interval(20.0, itl_s=None)])
    planner.step(60.0)
    assert planner.step(120.0).corrections["decode"] == 2.0


def test_a_zero_latency_is_no_measurement(profile):
    planner, _, _ = make(
        profile, [interval(20.0, itl_s=0.04), interval(20.0, ttft_s=0.0, itl_s=0.0)]
    )
    planner.step(60.0)
    assert planner.step(120.0).corrections == {"prefill": 1.0, "decode": 2.0}


def test_an_empty_interval_keeps_the_lengths_and_sizes_for_no_traffic(profile):
    empty = Observation(60.0, 0, 0.0, 0.0, None, None, 0.0)
    planner, _, _ = make(profile, [interval(20.0), empty], scale_down_cooldown_s=0.0)
    planner.step(60.0)
    decision = planner.step(120.0)
    assert decision.predicted == {"request_rate": 0.0, "prompt_tokens": 400.0,
                                  "output_tokens": 100.0}  # fmt: skip
    assert decision.formula == {"prefill": 0, "decode": 0}
    assert decision.desired == {"prefill": 1, "decode": 1}  # the minimums
    assert decision.limited_by == ("bounds",)


def test_scale_down_waits_for_the_cooldown(profile):
    planner, script, _ = make(profile, [interval(20.0), interval(4.0), interval(4.0)],
                              scale_down_cooldown_s=120.0)  # fmt: skip
    planner.step(60.0)  # up to 2 + 3: up has no cooldown
    held = planner.step(120.0)  # 60 s after the change
    assert (held.formula, held.desired) == ({"prefill": 1, "decode": 1},
                                            {"prefill": 2, "decode": 3})  # fmt: skip
    assert held.limited_by == ("cooldown",)
    assert planner.step(180.0).desired == {"prefill": 1, "decode": 1}
    assert script.calls == [("prefill", 2), ("decode", 3), ("prefill", 1), ("decode", 1)]


def test_the_budget_caps_the_total(profile):
    planner, _, _ = make(profile, [interval(40.0)], gpus_per_prefill=2, gpus_per_decode=2,
                         gpu_budget=12)  # fmt: skip
    decision = planner.step(60.0)
    # 4 prefill + 5 decode want 18 GPUs; x2/3: 2 and 3, the spare 2 GPUs to prefill
    assert decision.formula == {"prefill": 4, "decode": 5}
    assert decision.desired == {"prefill": 3, "decode": 3}
    assert decision.limited_by == ("gpu_budget",)


@pytest.mark.parametrize(("drain_s", "prefill"), [(None, 3), (10.0, 4)])
def test_the_backlog_is_drained_within_the_horizon(profile, drain_s, prefill):
    # 44,000 tokens queued; 1 worker prefills 2,000 within the 0.5 s target: 42,000 backlog.
    # Over one interval (60 s) 700 tokens/s: 8,000 / 4,000 + 700 / 4,000 = 2.175 -> 3; over
    # 10 s 4,200/s: 3.05 -> 4.
    backlogged = replace(interval(20.0), queued_prompt_tokens=44000.0)
    planner, _, _ = make(profile, [backlogged], backlog_drain_s=drain_s)
    decision = planner.step(60.0)
    assert (decision.queued_prompt_tokens, decision.backlog_tokens) == (44000.0, 42000.0)
    assert decision.formula == {"prefill": prefill, "decode": 3}


def test_a_queue_within_the_target_adds_nothing(profile):
    # 2,000 queued: what 1 worker prefills within 0.5 s
    planner, _, _ = make(profile, [replace(interval(20.0), queued_prompt_tokens=2000.0)])
    decision = planner.step(60.0)
    assert (decision.backlog_tokens, decision.formula["prefill"]) == (0.0, 2)


def test_the_backlog_check_grows_prefill_at_once(profile, caplog):
    planner, script, registry = make(profile, [interval(20.0)])
    planner.step(60.0)  # 2 prefill, 3 decode
    # within the target (2 x 4,000 x 0.5 = 4,000): nothing; then 16,000 queued (12,000 over)
    # with 12,000 prompt tokens/s arriving: 12,000 / 4,000 + 12,000 / 60 / 4,000 -> 4
    script.flows = [PrefillFlow(4000.0, 12000.0), PrefillFlow(16000.0, 12000.0)]
    assert planner.check_backlog(65.0) is None
    with caplog.at_level(logging.INFO, logger="pdserve.planner"):
        scale_up = planner.check_backlog(70.0)
    assert scale_up is not None
    assert (scale_up.backlog_tokens, scale_up.prompt_tokens, scale_up.formula) == (
        12000.0, 400.0, 4)  # fmt: skip
    assert scale_up.desired == {"prefill": 4, "decode": 3}
    assert scale_up.actual == {"prefill": 2, "decode": 3}
    assert scale_up.limited_by == ()
    assert script.calls[-1] == ("prefill", 4) and len(script.calls) == 3
    assert planner.backlog_scale_ups == [scale_up]
    logged = json.loads(caplog.records[-1].getMessage().removeprefix("planner backlog scale-up "))
    assert logged["desired"] == {"prefill": 4, "decode": 3}
    assert registry.get_sample_value("pdserve_planner_backlog_scale_ups_total") == 1
    assert registry.get_sample_value("pdserve_planner_replicas",
                                     {"pool": "prefill", "kind": "desired"}) == 4  # fmt: skip
    assert registry.get_sample_value("pdserve_planner_queued_prompt_tokens",
                                     {"kind": "backlog"}) == 12000.0  # fmt: skip


def test_the_backlog_check_keeps_decode_within_the_budget_and_never_shrinks(profile):
    planner, script, _ = make(profile, [interval(20.0)], gpu_budget=6)
    planner.step(60.0)  # 2 prefill, 3 decode
    script.flows = [PrefillFlow(16000.0, 12000.0), PrefillFlow(16000.0, 0.0)]
    scale_up = planner.check_backlog(65.0)
    assert scale_up is not None
    assert (scale_up.formula, scale_up.desired) == (4, {"prefill": 3, "decode": 3})
    assert scale_up.limited_by == ("gpu_budget",)
    # 10,000 over (3 workers: 6,000 within the target) but nothing arriving: 10,000 / 60 /
    # 4,000 -> 1 worker, fewer than the 3 there: no change
    assert planner.check_backlog(70.0) is None
    assert script.calls[-1] == ("prefill", 3)


def test_the_backlog_check_needs_a_source_that_tells(profile):
    planner, script, _ = make(profile, [interval(20.0)])
    planner.step(60.0)
    assert planner.check_backlog(65.0) is None  # the Script's flows are empty: None
    script.flows = [PrefillFlow(0.0, 12000.0), PrefillFlow(16000.0, 12000.0)]
    script.replicas = None  # an empty queue is no backlog: the pools are not even read
    assert planner.check_backlog(66.0) is None
    del script.replicas
    planner.settings = planner.settings.model_copy(update={"scale_up_cooldown_s": 30.0})
    assert planner.check_backlog(70.0) is None  # 10 s after the last change: cooling down


def test_metrics_export_the_decision(profile):
    planner, _, registry = make(profile, [interval(20.0, ttft_s=0.2)])
    planner.step(60.0)

    def value(name, **labels):
        return registry.get_sample_value(name, labels)

    assert value("pdserve_planner_replicas", pool="prefill", kind="desired") == 2
    assert value("pdserve_planner_replicas", pool="decode", kind="actual") == 1
    assert value("pdserve_planner_load", quantity="request_rate", kind="predicted") == 20.0
    assert value("pdserve_planner_load", quantity="prompt_tokens", kind="observed") == 400.0
    assert value("pdserve_planner_correction", pool="prefill") == 2.0
    assert value("pdserve_planner_slo_attainment") == 0.95
    assert value("pdserve_planner_decisions_total", changed="true") == 1


def test_settings_come_from_the_environment(monkeypatch):
    monkeypatch.setenv("PDSERVE_PLANNER_PREDICTOR", "ewma")
    monkeypatch.setenv("PDSERVE_PLANNER_GPU_BUDGET", "8")
    s = PlannerSettings()
    assert (s.predictor, s.gpu_budget) == ("ewma", 8)


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"min_decode": 3, "max_decode": 2}, "min_decode=3 > max_decode=2"),
        ({"min_prefill": 4, "gpus_per_prefill": 4, "gpu_budget": 16},
         "minimums need 17 GPUs, over gpu_budget=16"),
        ({"predictor": "arima"}, "predictor"),
    ],
)  # fmt: skip
def test_settings_that_cannot_work_are_refused(settings, message):
    with pytest.raises(ValueError, match=message):
        PlannerSettings(**settings)
