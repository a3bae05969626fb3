"""The local cost model: its terms, and the fit that recovers them from timed steps."""

from __future__ import annotations

import pytest

from engine.quantization import PLAIN_MAX_ROWS
from sim.calibrate import FEATURES, fit
from sim.costs import LocalCoefficients, LocalCost, StepShape

TERMS = {"overhead_s": 0.03, "per_prefill_token_s": 0.001, "per_attention_pair_s": 1e-6,
         "per_decode_s": 0.002, "per_decode_context_s": 4e-6, "per_small_step_s": 0.05}  # fmt: skip
MODEL = {"hidden_size": 576, "intermediate_size": 1536, "num_layers": 30, "num_heads": 9,
         "num_kv_heads": 3, "head_dim": 64, "vocab_size": 49152, "rms_norm_eps": 1e-5,
         "rope_theta": 1e5, "max_position_embeddings": 8192, "tie_word_embeddings": True,
         "attention_bias": False}  # fmt: skip


def cost(**terms: float) -> LocalCost:
    return LocalCost(LocalCoefficients(**terms, threads=1, model=MODEL, kv_bytes_per_token=46080))


def test_a_step_of_at_most_the_small_path_s_rows_pays_its_term_and_a_larger_one_does_not():
    model = cost(**TERMS)
    one = StepShape(num_decode=1, decode_context=100)
    at_limit = StepShape(num_decode=PLAIN_MAX_ROWS, decode_context=200)
    over = StepShape(num_decode=PLAIN_MAX_ROWS + 1, decode_context=300)
    assert model.step_s(one) == pytest.approx(0.03 + 0.002 + 4e-4 + 0.05)
    assert model.step_s(at_limit) == pytest.approx(0.03 + 0.004 + 8e-4 + 0.05)
    assert model.step_s(over) == pytest.approx(0.03 + 0.006 + 1.2e-3)
    # A prompt chunk's rows count too: one token alone is small, a chunk of 64 is not.
    assert model.step_s(StepShape(num_prefill_tokens=1, num_attention_pairs=1)) == pytest.approx(
        0.03 + 0.001 + 1e-6 + 0.05
    )
    assert model.step_s(StepShape(num_prefill_tokens=64)) == pytest.approx(0.03 + 0.064)


def test_coefficients_stored_before_the_small_step_term_load_without_it():
    terms = {k: v for k, v in TERMS.items() if k != "per_small_step_s"}
    assert cost(**terms).step_s(StepShape(num_decode=1)) == pytest.approx(0.032)


def test_the_fit_recovers_every_term_from_exact_step_times():
    model = cost(**TERMS)
    shapes = [StepShape(num_prefill_tokens=n, num_attention_pairs=n * (n + 1) // 2)
              for n in (32, 128, 384, 512)]  # fmt: skip
    shapes += [StepShape(num_decode=b, decode_context=b * c)
               for b in (1, 2, 4, 16, 32) for c in (33, 480)]  # fmt: skip
    coefficients, error = fit([(s, model.step_s(s)) for s in shapes])
    assert list(coefficients) == list(FEATURES)
    assert coefficients == pytest.approx(TERMS, rel=1e-6)
    assert error == pytest.approx(0.0, abs=1e-9)
