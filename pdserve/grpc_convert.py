"""Conversions at the gRPC boundary: proto messages <-> engine types, and errors -> status codes
(in one place, so every service answers the same way)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager

import grpc

from engine import EngineBusyError, InvalidRequestError, SamplingParams
from engine.errors import EngineDiedError, EngineStoppedError
from engine.request import StepOutput, TokenLogprobs
from engine.sampling_params import StructuredOutput
from engine.stop import StopReason
from pdserve.v1 import generation_pb2 as pb


class PrefillFailedError(RuntimeError):
    """No prefill worker filled the request's KV (each one tried is named)."""


class DeadlineExceededError(RuntimeError):
    """The request's deadline passed before it could be served."""


class CallerGoneError(RuntimeError):
    """The caller cancelled the request or went away."""


# Each typed error a worker can meet, and the status a client gets for it; the first class
# that matches wins, and anything else is an INTERNAL bug.
_STATUS_OF: list[tuple[type[BaseException], grpc.StatusCode]] = [
    (InvalidRequestError, grpc.StatusCode.INVALID_ARGUMENT),
    (EngineBusyError, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (EngineDiedError, grpc.StatusCode.INTERNAL),
    (EngineStoppedError, grpc.StatusCode.UNAVAILABLE),
    (PrefillFailedError, grpc.StatusCode.UNAVAILABLE),
    (DeadlineExceededError, grpc.StatusCode.DEADLINE_EXCEEDED),
    (CallerGoneError, grpc.StatusCode.CANCELLED),
]
_TYPED = tuple(kind for kind, _ in _STATUS_OF)


def status_of(error: BaseException) -> grpc.StatusCode:
    for kind, code in _STATUS_OF:
        if isinstance(error, kind):
            return code
    return grpc.StatusCode.INTERNAL


@contextmanager
def statuses(context: grpc.ServicerContext) -> Iterator[None]:
    """Wraps an RPC handler: a typed error ends the call with its status and message."""
    try:
        yield
    except _TYPED as e:
        context.abort(status_of(e), str(e))


_OPTIONAL_FIELDS = (
    "max_tokens", "temperature", "top_p", "top_k", "seed", "min_p", "presence_penalty",
    "frequency_penalty", "repetition_penalty", "logprobs", "n",
)  # fmt: skip


def sampling_params(proto: pb.SamplingParams, **overrides: object) -> SamplingParams:
    """Proto3 `optional` fields: unset means the engine's default."""
    fields: dict[str, object] = {}
    for name in _OPTIONAL_FIELDS:
        if proto.HasField(name):
            fields[name] = getattr(proto, name)
    fields.update(
        stop=tuple(proto.stop), stop_token_ids=tuple(proto.stop_token_ids),
        ignore_eos=proto.ignore_eos, include_stop_str_in_output=proto.include_stop_str_in_output,
        min_tokens=proto.min_tokens, logit_bias=dict(proto.logit_bias),
    )  # fmt: skip
    if proto.HasField("structured_output"):
        fields["structured_output"] = structured_output(proto.structured_output)
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
        include_stop_str_in_output=params.include_stop_str_in_output,
        min_p=params.min_p,
        presence_penalty=params.presence_penalty,
        frequency_penalty=params.frequency_penalty,
        repetition_penalty=params.repetition_penalty,
        min_tokens=params.min_tokens,
        logit_bias=params.logit_bias,
        logprobs=params.logprobs,
        n=params.n,
        structured_output=structured_output_proto(params.structured_output),
    )


def structured_output(proto: pb.StructuredOutput) -> StructuredOutput:
    kind = proto.WhichOneof("constraint")
    if kind is None:
        raise InvalidRequestError("structured_output sets no constraint")
    if kind == "choice":
        return StructuredOutput("choice", json.dumps(list(proto.choice.choices)))
    return StructuredOutput(kind, "" if kind == "json_object" else getattr(proto, kind))


def structured_output_proto(constraint: StructuredOutput | None) -> pb.StructuredOutput | None:
    if constraint is None:
        return None
    if constraint.kind == "choice":
        return pb.StructuredOutput(choice=pb.Choices(choices=json.loads(constraint.spec)))
    if constraint.kind == "json_object":
        return pb.StructuredOutput(json_object=True)
    return pb.StructuredOutput(**{constraint.kind: constraint.spec})


def response(output: StepOutput) -> pb.GenerateResponse:
    message = pb.GenerateResponse(
        request_id=output.request_id,
        token_ids=output.new_token_ids,
        text=output.text_delta,
        finish_reason=output.finish_reason or "",
        index=output.index,
    )
    set_stop_reason(message, output.stop_reason)
    message.logprobs.extend(logprobs_proto(lp) for lp in output.logprobs)
    return message


def logprobs_proto(logprobs: TokenLogprobs) -> pb.TokenLogprobs:
    return pb.TokenLogprobs(
        sampled=pb.Logprob(token_id=logprobs.token_id, logprob=logprobs.logprob),
        top=[pb.Logprob(token_id=t, logprob=lp) for t, lp in logprobs.top],
    )


def token_logprobs(proto: pb.TokenLogprobs) -> TokenLogprobs:
    top = tuple((lp.token_id, lp.logprob) for lp in proto.top)
    return TokenLogprobs(proto.sampled.token_id, proto.sampled.logprob, top)


def set_stop_reason(message: pb.GenerateResponse, reason: StopReason) -> None:
    if isinstance(reason, str):
        message.stop_str = reason
    elif isinstance(reason, int):
        message.stop_token_id = reason


def stop_reason_of(message: pb.GenerateResponse) -> StopReason:
    """vLLM's stop_reason: the stop string, the stop token id, or None."""
    kind = message.WhichOneof("stop_reason")
    return None if kind is None else getattr(message, kind)
