"""`pdserve sim validate`'s in-situ measurements: a role's real step seconds over its simulated
ones on the calibration runs, applied to that role's workers' steps in the prediction, and the
host processes' CPU per request, net of what they spend idle."""

from __future__ import annotations

import pytest

from sim import validate
from sim.costs import LocalCoefficients
from sim.validate import (
    CALIBRATION_REQUESTS,
    HOST_CPU_PER_TOKEN,
    IDLE_S,
    SHAPES,
    HostCPU,
    host_cpu_s,
    in_situ_factors,
    predict,
    source,
)
from tests.sim.test_costs import MODEL, TERMS

COEFFICIENTS = LocalCoefficients(**TERMS, threads=1, model=MODEL, kv_bytes_per_token=46080)
ONE_P_ONE_D = next(shape for shape in SHAPES if shape.label == "1P+1D")


def test_a_factor_is_the_role_s_real_over_simulated_step_seconds():
    real = {"prefill-0": 12.0, "prefill-1": 8.0, "decode-0": 9.0, "aggregated-0": 5.0}
    simulated = {"prefill-0": 10.0, "prefill-1": 6.0, "decode-0": 10.0, "aggregated-0": 0.0}
    assert in_situ_factors(real, simulated) == {"prefill": 1.25, "decode": 0.9}


def test_a_worker_s_factor_scales_its_steps_in_the_prediction(monkeypatch):
    # One client: each prompt is prefilled alone, so the steps are the same ones either way
    # (with four, slower steps change which prompts meet at the worker and how they are split).
    monkeypatch.setattr(validate, "CONCURRENCY", 1)

    def steps(in_situ):
        _, step_s = predict(ONE_P_ONE_D, source("prompt_mix", 12, seed=3), 12, COEFFICIENTS,
                            num_cores=2, in_situ=in_situ)  # fmt: skip
        return step_s

    plain = steps(None)
    slower = steps({"prefill": 1.5, "decode": 1.0})
    # 12 prompts of one prefill worker: every step 1.5x as long.
    assert slower["prefill-0"] == pytest.approx(1.5 * plain["prefill-0"], abs=0.02)
    assert slower["decode-0"] > 0


def test_the_host_cpu_per_request_leaves_out_what_the_processes_spend_idle():
    workers = {"prefill-0": 30.0, "decode-0": 40.0}
    idle_per_s = {"router": 0.01, "client": 0.012, "redis": 0.003, "prefill-0": 0.5}
    spent = {
        "calibration_step_s": workers,
        "calibration_s": 20.0,
        "calibration_requests": CALIBRATION_REQUESTS,
        # idle at those rates for the 20 s, plus 25 ms a request of the router and 10 of the
        # client (the workers' CPU is theirs, never the host's)
        "calibration_cpu_s": {
            "router": 20 * 0.01 + CALIBRATION_REQUESTS * 0.025,
            "client": 20 * 0.012 + CALIBRATION_REQUESTS * 0.010,
            "redis": 20 * 0.003,
            "prefill-0": 55.0,
            "decode-0": 41.0,
        },
        "idle_cpu_s": {name: rate * IDLE_S for name, rate in idle_per_s.items()},
    }
    assert host_cpu_s(spent) == pytest.approx(0.035)
    spent["calibration_cpu_s"] = {name: 0.0 for name in spent["calibration_cpu_s"]}
    assert host_cpu_s(spent) == 0.0  # never below nothing


def test_the_host_cpu_slows_the_simulated_steps_it_runs_beside():
    def steps(host: HostCPU):
        _, step_s = predict(ONE_P_ONE_D, source("prompt_mix", 12, seed=3), 12, COEFFICIENTS,
                            num_cores=2, host_cpu=host)  # fmt: skip
        return step_s

    plain, busy = steps(HostCPU()), steps(HostCPU(per_request_s=0.5))
    # Two single-thread workers and a half-second burst per request on two cores: whoever
    # steps beside a burst gets 2/3 of a core.
    assert busy["prefill-0"] > plain["prefill-0"] + 0.5
    # A second a streamed token: 8 tokens a request, each a burst beside the decode steps.
    streaming = steps(HostCPU(per_token_s=1.0))
    assert streaming["decode-0"] > plain["decode-0"] + 0.5


def test_the_host_cpu_measured_is_split_into_a_request_s_part_and_each_token_s():
    host = HostCPU.split(0.030, 16)  # chat: 16 tokens a request
    assert host.per_request_s == pytest.approx(0.030 / (1 + 16 * HOST_CPU_PER_TOKEN))
    assert host.per_token_s == pytest.approx(HOST_CPU_PER_TOKEN * host.per_request_s)
    assert host.per_request_s + 16 * host.per_token_s == pytest.approx(0.030)
