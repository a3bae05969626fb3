"""Conversions at the gRPC boundary: proto messages <-> engine types, and errors -> status codes
(in one place, so every service answers the same way)."""

from __future__ import annotations

from collections.abc import Callable
from typing import NoReturn

import grpc

from engine import InsufficientKVError, InvalidRequestError, SamplingParams
from engine.request import StepOutput
from pdserve.v1 import generation_pb2 as pb

# Each typed error a worker can meet, and the status a client gets for it.
_STATUS_OF: list[tuple[type[BaseException], grpc.StatusCode]] = [
    (InvalidRequestError, grpc.StatusCode.INVALID_ARGUMENT),
    (InsufficientKVError, grpc.StatusCode.RESOURCE_EXHAUSTED),
]


def status_of(error: BaseException) -> grpc.StatusCode:
    for kind, code in _STATUS_OF:
        if isinstance(error, kind):
            return code
    return grpc.StatusCode.INTERNAL


def abort_with(context: grpc.ServicerContext, error: BaseException) -> NoReturn:
    context.abort(status_of(error), str(error))


def call_or_abort(context: grpc.ServicerContext, fn: Callable[[], object]):
    """Runs fn; a typed engine error becomes the matching gRPC status for the caller."""
    try:
        return fn()
    except (InvalidRequestError, InsufficientKVError) as e:
        abort_with(context, e)


def sampling_params(proto: pb.SamplingParams, **overrides: object) -> SamplingParams:
    """Proto3 `optional` fields: unset means the engine's default."""
    fields: dict[str, object] = {}
    for name in ("max_tokens", "temperature", "top_p", "top_k", "seed"):
        if proto.HasField(name):
            fields[name] = getattr(proto, name)
    fields.update(
        stop=tuple(proto.stop), stop_token_ids=tuple(proto.stop_token_ids),
        ignore_eos=proto.ignore_eos,
    )  # fmt: skip
    fields.update(overrides)
    return SamplingParams(**fields)


def sampling_proto(params: SamplingParams) -> pb.SamplingParams:
    return pb.SamplingParams(
        max_tokens=params.max_tokens,
        temperature=params.temperature,
        top_p=params.top_p,
        top_k=params.top_k,
        seed=params.seed,
        stop=list(params.stop),
        stop_token_ids=list(params.stop_token_ids),
        ignore_eos=params.ignore_eos,
    )


def response(output: StepOutput) -> pb.GenerateResponse:
    return pb.GenerateResponse(
        request_id=output.request_id,
        token_ids=output.new_token_ids,
        text=output.text_delta,
        finish_reason=output.finish_reason or "",
    )
