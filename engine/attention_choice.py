"""Which attention backend runs: a setting (auto, sdpa, cpu_paged, flashinfer, flash_attn) and the
device
-> a backend that passed its self-check (docs/engine.md). Apart from engine/attention.py, which
the paged backends import for their base class, so the choice never makes a module cycle."""

from __future__ import annotations

import logging
from collections.abc import Callable

from engine.attention import AttentionBackend, AttentionSpec, BackendUnusableError, TorchSDPABackend

log = logging.getLogger(__name__)


def _cpu_paged(spec: AttentionSpec) -> AttentionBackend:
    from engine.cpu_paged_backend import CPUPagedBackend

    return CPUPagedBackend(spec)


def _flashinfer(spec: AttentionSpec) -> AttentionBackend:
    from engine.flashinfer_backend import FlashInferBackend

    return FlashInferBackend(spec)


def _flash_attn(spec: AttentionSpec) -> AttentionBackend:
    from engine.flash_attn_backend import FlashAttnBackend

    return FlashAttnBackend(spec)


# auto tries these in order for the device's type; SDPA always works and ends each list.
_PAGED_BACKENDS: dict[str, dict[str, Callable[[AttentionSpec], AttentionBackend]]] = {
    "cuda": {"flashinfer": _flashinfer, "flash_attn": _flash_attn},
    "cpu": {"cpu_paged": _cpu_paged},
}
_DEVICE_OF = {name: device for device, names in _PAGED_BACKENDS.items() for name in names}


def select_backend(name: str, spec: AttentionSpec) -> AttentionBackend:
    """The backend for this setting, logging which one runs and why. A backend asked for by
    name that cannot run is an error; auto falls through to the next one."""
    if name == "sdpa":
        log.info("attention backend: sdpa (asked for by attention_backend=sdpa)")
        return TorchSDPABackend(spec)
    if name in _DEVICE_OF:
        device = _DEVICE_OF[name]
        if spec.device.type != device:
            raise ValueError(
                f"attention_backend {name} needs a {device.upper()} device, not {spec.device}"
            )
        backend = _PAGED_BACKENDS[device][name](spec)  # raises BackendUnusableError: its reason
        log.info("attention backend: %s (asked for by attention_backend=%s)", name, name)
        return backend
    candidates = _PAGED_BACKENDS.get(spec.device.type, {})
    reasons = []
    for candidate, make in candidates.items():
        try:
            backend = make(spec)
        except (BackendUnusableError, ImportError) as e:
            reasons.append(f"{candidate}: {e}")
            continue
        log.info("attention backend: %s (auto; first to load and pass its self-check)", candidate)
        return backend
    if not candidates:
        log.info("attention backend: sdpa (device %s has no paged kernel here)", spec.device)
        return TorchSDPABackend(spec)
    log.warning(
        "attention backend: sdpa (auto fell back; it gathers blocks per decode step): %s",
        "; ".join(reasons),
    )
    return TorchSDPABackend(spec)
