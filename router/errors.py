"""Typed errors the router answers with, and the one table mapping each to its HTTP status,
OpenAI error type and gRPC status code."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import grpc

RejectReason = Literal["queue_full", "queue_wait", "queue_timeout", "kv_headroom", "decode_kv"]


class RouterError(Exception):
    """A request the router answers with an error; param/code fill OpenAI's error body."""

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code


class InvalidRequestError(RouterError):
    pass


class PromptTooLongError(InvalidRequestError):
    def __init__(self, message: str, param: str = "prompt") -> None:
        super().__init__(message, param=param, code="context_length_exceeded")


class BodyTooLargeError(RouterError):
    def __init__(self, num_bytes: int, max_bytes: int) -> None:
        super().__init__(f"request body of {num_bytes} bytes is over the {max_bytes}-byte limit")


class UnauthorizedError(RouterError):
    def __init__(self) -> None:
        super().__init__(
            "missing or wrong API key: send 'Authorization: Bearer <key>'", code="invalid_api_key"
        )


class NotFoundError(RouterError):
    pass


class OverloadedError(RouterError):
    """Backpressure: retry after retry_after_s (Retry-After / grpc-retry-pushback-ms)."""

    def __init__(self, reason: RejectReason, message: str, retry_after_s: float) -> None:
        super().__init__(f"{message}; retry in {retry_after_s:.0f} s", code="rate_limit_exceeded")
        self.reason = reason
        self.retry_after_s = retry_after_s

    @property
    def retry_after_header(self) -> str:
        return str(max(1, math.ceil(self.retry_after_s)))


class UnavailableError(RouterError):
    """No worker can take the request (none registered, or the chosen one failed)."""


class WorkerLostError(UnavailableError):
    """The decode worker went away mid-request (connection lost, stream cut short, request
    aborted): the request may move to another worker (gateway.Run migrates it)."""


class UpstreamError(RouterError):
    """A worker answered with an error that is neither the client's fault nor load."""


class DeadlineExceededError(RouterError):
    """The request's deadline (--request-timeout-s, or the gRPC client's own) passed."""

    def __init__(self, message: str) -> None:
        super().__init__(message, code="timeout")


@dataclass(frozen=True, slots=True)
class Status:
    http: int
    openai_type: str
    grpc: grpc.StatusCode


# The one mapping; the first class that matches wins.
_STATUS: list[tuple[type[RouterError], Status]] = [
    (InvalidRequestError, Status(400, "invalid_request_error", grpc.StatusCode.INVALID_ARGUMENT)),
    (UnauthorizedError, Status(401, "authentication_error", grpc.StatusCode.UNAUTHENTICATED)),
    (NotFoundError, Status(404, "invalid_request_error", grpc.StatusCode.NOT_FOUND)),
    (BodyTooLargeError, Status(413, "invalid_request_error", grpc.StatusCode.INVALID_ARGUMENT)),
    (OverloadedError, Status(429, "rate_limit_error", grpc.StatusCode.RESOURCE_EXHAUSTED)),
    (UpstreamError, Status(502, "api_error", grpc.StatusCode.INTERNAL)),
    (DeadlineExceededError, Status(504, "timeout_error", grpc.StatusCode.DEADLINE_EXCEEDED)),
    (UnavailableError, Status(503, "service_unavailable", grpc.StatusCode.UNAVAILABLE)),
]
INTERNAL = Status(500, "api_error", grpc.StatusCode.INTERNAL)


def status_of(error: RouterError) -> Status:
    for kind, status in _STATUS:
        if isinstance(error, kind):
            return status
    return INTERNAL
