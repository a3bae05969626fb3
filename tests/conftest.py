"""Shared fixtures: the real bundled model, converted once per machine."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def model_dir():
    from engine.model_files import resolve_model

    return resolve_model("smollm2-135m")


@pytest.fixture(scope="session")
def llm():
    """One fp32 engine shared by the tests that leave it idle (they assert they do)."""
    from engine import LLM

    return LLM(num_threads=2)
