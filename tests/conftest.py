"""Shared fixtures: the real bundled model, converted once per machine."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# `make test` runs two test files at a time (pytest-xdist), so an engine's two OpenMP threads
# share the cores with another file's processes. libgomp's default spins at each barrier for the
# thread that was descheduled: a 2-thread matmul loop took 4-12x longer beside other processes
# than with passive waits (docs/measurements.md). Read by libgomp when torch loads it, so it is
# set before any test module imports torch.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# The suite's expected tokens are the CPU's (fp32 is HF's; the CPU default runs the GGUF's int4
# codes), so the worker processes it starts run on the CPU on any host. What holds on CUDA is
# asserted where a test asks for cuda (tests/engine/test_device.py) and by bench/gpu_check.py.
os.environ.setdefault("PDSERVE_DEVICE", "cpu")


@pytest.fixture(scope="session")
def model_dir():
    from engine.model_files import resolve_model

    return resolve_model("smollm2-135m")


@pytest.fixture(scope="session")
def llm():
    """One fp32 engine on the CPU shared by the tests that leave it idle (they assert they do).
    The device and the weights are pinned: on a CUDA host auto would pick cuda in bfloat16, on
    the CPU the default runs the GGUF's int4 codes, and the tests' expected tokens are the CPU
    fp32 ones (HF's)."""
    from engine import LLM

    return LLM(num_threads=2, device="cpu", quantization="none")


@pytest.fixture(scope="session")
def hf_model(model_dir):
    """Hugging Face transformers on the same weights, fp32: the reference implementation."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(2)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    # No eos id: generation runs on through <|im_end|> exactly like ignore_eos does.
    model.generation_config.eos_token_id = None
    return model


@pytest.fixture(scope="session")
def hf_logits(hf_model):
    """token ids -> HF's fp32 logits [len, vocab]: row i predicts the token after ids[i]."""
    import torch

    def logits(token_ids: list[int]) -> torch.Tensor:
        with torch.no_grad():  # not inference_mode: the tests edit the rows they get
            return hf_model(torch.tensor([token_ids])).logits[0].float()

    return logits
