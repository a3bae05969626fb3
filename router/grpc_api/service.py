"""pdserve.v1.Generation: the same request path as the HTTP API, and the one place router
errors become gRPC statuses."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import NoReturn

import grpc

from pdserve import grpc_convert
from pdserve.v1 import generation_pb2 as pb
from pdserve.v1 import generation_pb2_grpc
from router import metrics
from router.auth import check_bearer
from router.errors import InvalidRequestError, OverloadedError, RouterError, status_of
from router.gateway import Gateway, Run

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Generation"].full_name


class GenerationService(generation_pb2_grpc.GenerationServicer):
    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway

    async def Generate(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        run = await self._open(request, context, "Generate")
        metrics.REQUESTS.labels("grpc/Generate", "OK").inc()  # a later error ends the stream
        try:
            async for message in run.messages():
                message.request_id = request.request_id or message.request_id
                yield message
        except RouterError as e:
            await _abort(context, e, "Generate")
        finally:
            run.close()  # also when the client cancels: that cancels the decode call

    async def Complete(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> pb.GenerateResponse:
        run = await self._open(request, context, "Complete")
        try:
            gathered = await run.gather()
        except RouterError as e:
            await _abort(context, e, "Complete")
        finally:
            run.close()
        # Sample 0 at the top level, as with n = 1; with n > 1 every sample in choices too.
        whole = pb.GenerateResponse()
        whole.CopyFrom(gathered.samples[0])
        if len(gathered.samples) > 1:
            whole.choices.extend(gathered.samples)
        whole.usage.CopyFrom(gathered.usage)
        if gathered.ttft is not None:
            whole.ttft.CopyFrom(gathered.ttft)
        whole.request_id = request.request_id or run.job.ticket.request_id
        metrics.REQUESTS.labels("grpc/Complete", "OK").inc()
        return whole

    async def _open(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext, method: str
    ) -> Run:
        received_s = time.monotonic()
        gateway = self.gateway
        try:
            _authorize(context, gateway.settings.api_key)
            kind = request.WhichOneof("prompt")
            if kind is None:
                raise InvalidRequestError("the request has no prompt: set text or token_ids")
            ids = (
                await gateway.tokenize(request.text)
                if kind == "text"
                else list(request.token_ids.ids)
            )
            job = gateway.job(
                ids, lambda room: grpc_convert.sampling_params(request.params), received_s,
                client_timeout_s=context.time_remaining(),
            )  # fmt: skip
            run = await gateway.open(job)
        except RouterError as e:
            await _abort(context, e, method)
        return run


def _authorize(context: grpc.aio.ServicerContext, api_key: str | None) -> None:
    metadata = dict(context.invocation_metadata() or ())
    check_bearer(str(metadata.get("authorization", "")), api_key)


async def _abort(context: grpc.aio.ServicerContext, error: RouterError, method: str) -> NoReturn:
    code = status_of(error).grpc
    metrics.REQUESTS.labels(f"grpc/{method}", code.name).inc()
    trailers: tuple[tuple[str, str], ...] = ()
    if isinstance(error, OverloadedError):  # gRPC's retry policies honour this pushback
        trailers = (("grpc-retry-pushback-ms", str(int(error.retry_after_s * 1000))),)
    await context.abort(code, error.message, trailing_metadata=trailers)
