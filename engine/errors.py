"""Typed engine errors: bad input is reported with the numbers, never by a crash."""

from __future__ import annotations


class EngineError(ValueError):
    """Base class for every error the engine reports to a caller."""


class InvalidRequestError(EngineError):
    """A request the engine can never serve as given (bad sampling value, empty prompt, ...)."""


class PromptTooLongError(InvalidRequestError):
    def __init__(self, num_prompt_tokens: int, max_model_len: int) -> None:
        super().__init__(
            f"prompt has {num_prompt_tokens} tokens, but this model's context is "
            f"{max_model_len} tokens (the prompt must leave room for at least one new token)"
        )
        self.num_prompt_tokens = num_prompt_tokens
        self.max_model_len = max_model_len


class UnknownModelError(EngineError):
    def __init__(self, name: str, known: list[str]) -> None:
        super().__init__(
            f"unknown model {name!r}: give one of {known}, a .gguf file, "
            "or a Hugging Face directory (config.json + *.safetensors)"
        )
        self.name = name


class EngineBusyError(EngineError):
    """The engine cannot take more work right now (a retryable, load-related error)."""


class InsufficientKVError(EngineBusyError):
    """The decode pool cannot hold this prompt right now."""

    def __init__(self, num_needed: int, num_free: int) -> None:
        super().__init__(f"prompt needs {num_needed} KV blocks, {num_free} free")
        self.num_needed = num_needed
        self.num_free = num_free


class EngineStoppedError(RuntimeError):
    """The engine loop is stopped (shutting down): retry elsewhere."""


class EngineDiedError(EngineStoppedError):
    """The engine thread died of an unexpected error: its state can no longer be trusted."""
