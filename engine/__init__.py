"""The model engine shared by prefill and decode workers: model, paged KV cache, scheduler."""

from engine.config import EngineConfig, ModelConfig
from engine.errors import (
    EngineBusyError,
    EngineError,
    InsufficientKVError,
    InvalidRequestError,
    PromptTooLongError,
    UnknownModelError,
)
from engine.llm import LLM
from engine.llm_engine import EngineStats, LLMEngine
from engine.request import RequestOutput, StepOutput
from engine.sampling import SamplingParams

__all__ = [
    "LLM",
    "EngineBusyError",
    "EngineConfig",
    "EngineError",
    "EngineStats",
    "InsufficientKVError",
    "InvalidRequestError",
    "LLMEngine",
    "ModelConfig",
    "PromptTooLongError",
    "RequestOutput",
    "SamplingParams",
    "StepOutput",
    "UnknownModelError",
]
