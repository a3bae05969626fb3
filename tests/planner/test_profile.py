"""Interpolating the profile: exact values between, at and beyond the timed points."""

from __future__ import annotations

import pytest

from planner.profile import DecodeProfile, PrefillProfile, Profile, ProfileError


def test_prefill_interpolates_and_extends_past_the_ends(profile):
    prefill = profile.prefill
    assert prefill.ttft_s(400) == 0.1
    assert prefill.ttft_s(700) == pytest.approx(0.175, abs=1e-12)
    assert prefill.ttft_s(1600) == pytest.approx(0.4, abs=1e-12)  # the last segment extended
    assert prefill.tokens_per_s(1000) == 4000


def test_decode_itl_uses_the_timed_context_at_or_above(profile):
    decode = profile.decode
    assert decode.itl(8, 512) == 0.02
    assert decode.itl(8, 513) == 0.04  # context 2048's row: conservative
    assert decode.itl(20, 512) == pytest.approx(0.03, abs=1e-12)
    assert decode.itl(0, 512) == 0.01  # an idle worker's next step is batch 1's
    assert decode.itl(8, 10_000) == 0.04  # beyond the longest context: the longest row


def test_best_decode_rate_is_the_largest_batch_within_the_target(profile):
    decode = profile.decode
    assert decode.best_tokens_per_s(0.05, 512) == 800  # batch 32 in 40 ms
    assert decode.best_tokens_per_s(0.03, 512) == 400  # batch 8 in 20 ms
    assert decode.best_tokens_per_s(0.05, 2048) == 200  # batch 8 in 40 ms
    assert decode.best_tokens_per_s(0.005, 512) == 100  # nothing meets it: batch 1's rate


def test_a_bad_profile_is_refused_with_its_values():
    with pytest.raises(ProfileError, match="strictly increasing"):
        PrefillProfile((400, 400), (0.1, 0.2))
    with pytest.raises(ProfileError, match="positive time per length"):
        PrefillProfile((400,), (0.0,))
    with pytest.raises(ProfileError, match="per \\(context, batch size\\)"):
        DecodeProfile((512,), (1, 8), ((0.01,),))


def test_profile_round_trips_through_json(profile, tmp_path):
    path = tmp_path / "profile.json"
    profile.save(path)
    assert Profile.load(path) == profile
