"""Which attention backend runs: a setting (auto, sdpa, flashinfer, flash_attn) and the device
-> a backend that passed its self-check (docs/engine.md). Apart from engine/attention.py, which
the paged backends import for their base class, so the choice never makes a module cycle."""

from __future__ import annotations

import logging
from collections.abc import Callable

from engine.attention import AttentionBackend, AttentionSpec, BackendUnusableError, TorchSDPABackend

log = logging.getLogger(__name__)


def _flashinfer(spec: AttentionSpec) -> AttentionBackend:
    from engine.flashinfer_backend import FlashInferBackend

    return FlashInferBackend(spec)


def _flash_attn(spec: AttentionSpec) -> AttentionBackend:
    from engine.flash_attn_backend import FlashAttnBackend

    return FlashAttnBackend(spec)


# auto tries these in order on CUDA; SDPA always works and ends the list.
_CUDA_BACKENDS: dict[str, Callable[[AttentionSpec], AttentionBackend]] = {
    "flashinfer": _flashinfer,
    "flash_attn": _flash_attn,
}


def select_backend(name: str, spec: AttentionSpec) -> AttentionBackend:
    """The backend for this setting, logging which one runs and why. A backend asked for by
    name that cannot run is an error; auto falls through to the next one."""
    if name == "sdpa":
        log.info("attention backend: sdpa (asked for by attention_backend=sdpa)")
        return TorchSDPABackend(spec)
    if name in _CUDA_BACKENDS:
        if spec.device.type != "cuda":
            raise ValueError(f"attention_backend {name} needs a CUDA device, not {spec.device}")
        backend = _CUDA_BACKENDS[name](spec)  # raises BackendUnusableError with its reason
        log.info("attention backend: %s (asked for by attention_backend=%s)", name, name)
        return backend
    if spec.device.type != "cuda":
        log.info("attention backend: sdpa (device %s; paged kernels are CUDA-only)", spec.device)
        return TorchSDPABackend(spec)
    reasons = []
    for candidate, make in _CUDA_BACKENDS.items():
        try:
            backend = make(spec)
        except (BackendUnusableError, ImportError) as e:
            reasons.append(f"{candidate}: {e}")
            continue
        log.info("attention backend: %s (auto; first to load and pass its self-check)", candidate)
        return backend
    log.warning(
        "attention backend: sdpa (auto fell back; it gathers blocks per decode step): %s",
        "; ".join(reasons),
    )
    return TorchSDPABackend(spec)
