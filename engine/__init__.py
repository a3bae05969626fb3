"""The model engine shared by prefill and decode workers: model, paged KV cache, scheduler.

Names are imported on first use (PEP 562), so that `from engine import SamplingParams` in the
router loads the torch-free modules only; the model, runner and loop bring torch with them."""

from importlib import import_module

_EXPORTS = {
    "EngineConfig": "engine.config",
    "ModelConfig": "engine.config",
    "EngineBusyError": "engine.errors",
    "EngineError": "engine.errors",
    "InsufficientKVError": "engine.errors",
    "InvalidRequestError": "engine.errors",
    "PromptTooLongError": "engine.errors",
    "UnknownModelError": "engine.errors",
    "LLM": "engine.llm",
    "EngineStats": "engine.llm_engine",
    "LLMEngine": "engine.llm_engine",
    "RequestOutput": "engine.request",
    "StepOutput": "engine.request",
    "SamplingParams": "engine.sampling_params",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> object:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'engine' has no attribute {name!r}")
    value = getattr(import_module(_EXPORTS[name]), name)
    globals()[name] = value  # later lookups skip this function
    return value
