"""`pdserve sim validate`'s in-situ factors: a role's real step seconds over its simulated ones
on the calibration run, applied to that role's workers' steps in the prediction."""

from __future__ import annotations

import pytest

from sim.costs import LocalCoefficients
from sim.validate import SHAPES, in_situ_factors, predict, source
from tests.sim.test_costs import MODEL, TERMS

COEFFICIENTS = LocalCoefficients(**TERMS, threads=1, model=MODEL, kv_bytes_per_token=46080)
ONE_P_ONE_D = next(shape for shape in SHAPES if shape.label == "1P+1D")


def test_a_factor_is_the_role_s_real_over_simulated_step_seconds():
    real = {"prefill-0": 12.0, "prefill-1": 8.0, "decode-0": 9.0, "aggregated-0": 5.0}
    simulated = {"prefill-0": 10.0, "prefill-1": 6.0, "decode-0": 10.0, "aggregated-0": 0.0}
    assert in_situ_factors(real, simulated) == {"prefill": 1.25, "decode": 0.9}


def test_a_worker_s_factor_scales_its_steps_in_the_prediction():
    def steps(in_situ):
        _, step_s = predict(ONE_P_ONE_D, source("prompt_mix", 12, seed=3), 12, COEFFICIENTS,
                            num_cores=2, in_situ=in_situ)  # fmt: skip
        return step_s

    plain = steps(None)
    slower = steps({"prefill": 1.5, "decode": 1.0})
    # 12 prompts of one prefill worker, each prefilled alone: every step 1.5x as long.
    assert slower["prefill-0"] == pytest.approx(1.5 * plain["prefill-0"], abs=0.02)
    assert slower["decode-0"] > 0
