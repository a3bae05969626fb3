"""A profile small enough to work replica counts out by hand."""

from __future__ import annotations

import pytest

from planner.profile import DecodeProfile, PrefillProfile, Profile


@pytest.fixture
def profile() -> Profile:
    """Prefill: 0.1 s per 400 tokens (4,000 tokens/s), 0.25 s per 1,000 (4,000/s).
    Decode at context 512: batch 1 -> 10 ms, 8 -> 20 ms (400 tok/s), 32 -> 40 ms (800 tok/s);
    at context 2048 everything twice as slow."""
    return Profile(
        PrefillProfile((400, 1000), (0.1, 0.25)),
        DecodeProfile((512, 2048), (1, 8, 32),
                      ((0.01, 0.02, 0.04), (0.02, 0.04, 0.08))),
    )  # fmt: skip
