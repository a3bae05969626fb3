"""Calls to decode workers: one gRPC channel per worker (plain, TLS or mTLS), the streaming
Decode.Generate call under the request's deadline, and the mapping of a worker's error status
to a router error."""

from __future__ import annotations

import grpc

from pdserve import keepalive
from pdserve.tls import TLSFiles, channel_credentials
from pdserve.worker.v1 import worker_pb2 as wpb
from pdserve.worker.v1 import worker_pb2_grpc
from router.errors import (
    DeadlineExceededError,
    InvalidRequestError,
    OverloadedError,
    RouterError,
    UpstreamError,
    WorkerLostError,
)

_CHANNEL_OPTIONS = [("grpc.max_receive_message_length", 64 << 20), *keepalive.CHANNEL_OPTIONS]


class DecodeClient:
    def __init__(self, tls: TLSFiles) -> None:
        self._credentials = channel_credentials(tls) if tls.enabled else None
        self._stubs: dict[str, worker_pb2_grpc.DecodeStub] = {}
        self._channels: list[grpc.aio.Channel] = []

    def generate(
        self, address: str, request: wpb.DecodeRequest, timeout_s: float
    ) -> grpc.aio.UnaryStreamCall:
        """The stream of GenerateResponse messages; cancel() the call to abort the request.
        The worker sees the deadline (context.time_remaining()) and spends no more."""
        return self._stub(address).Generate(request, timeout=timeout_s)

    def _stub(self, address: str) -> worker_pb2_grpc.DecodeStub:
        stub = self._stubs.get(address)
        if stub is None:
            if self._credentials is None:
                channel = grpc.aio.insecure_channel(address, options=_CHANNEL_OPTIONS)
            else:
                channel = grpc.aio.secure_channel(address, self._credentials, _CHANNEL_OPTIONS)
            self._channels.append(channel)
            stub = self._stubs[address] = worker_pb2_grpc.DecodeStub(channel)
        return stub

    async def close(self) -> None:
        for channel in self._channels:
            await channel.close()


def error_of(error: grpc.aio.AioRpcError, address: str) -> RouterError:
    """A decode worker's status, as the router's client should see it."""
    code, details = error.code(), error.details() or ""
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        return InvalidRequestError(details)
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return OverloadedError("decode_kv", f"decode worker {address}: {details}", 1.0)
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return DeadlineExceededError(f"the request's deadline passed on decode worker {address}")
    if code == grpc.StatusCode.UNAVAILABLE:  # connection lost, or it could not serve it now
        return WorkerLostError(f"decode worker {address} is unavailable: {details}")
    return UpstreamError(f"decode worker {address} failed: {code.name} {details}")
