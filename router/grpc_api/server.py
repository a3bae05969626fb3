"""The public gRPC server: Generation, grpc.health.v1 and reflection, plain or TLS (mTLS
when a CA file is given)."""

from __future__ import annotations

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from pdserve.tls import server_credentials
from pdserve.v1 import generation_pb2_grpc
from router.gateway import Gateway
from router.grpc_api.service import SERVICE_NAME, GenerationService

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class PublicGrpcServer:
    def __init__(self, gateway: Gateway) -> None:
        settings = gateway.settings
        self.server = grpc.aio.server(
            options=[("grpc.max_receive_message_length", settings.max_body_bytes)]
        )
        generation_pb2_grpc.add_GenerationServicer_to_server(
            GenerationService(gateway), self.server
        )
        self.health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        reflection.enable_server_reflection(
            (SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), self.server
        )
        address = f"{settings.host}:{settings.grpc_port}"
        if settings.tls.enabled:
            self.port = self.server.add_secure_port(address, server_credentials(settings.tls))
        else:
            self.port = self.server.add_insecure_port(address)

    async def start(self) -> None:
        await self.server.start()
        # "" is liveness (the process serves); the Generation service is readiness (workers
        # of both roles are registered), set by the router as the registry changes.
        await self.health.set("", SERVING)
        await self.health.set(SERVICE_NAME, NOT_SERVING)

    async def set_ready(self, ready: bool) -> None:
        await self.health.set(SERVICE_NAME, SERVING if ready else NOT_SERVING)

    async def stop(self, grace_s: float) -> None:
        await self.health.enter_graceful_shutdown()
        await self.server.stop(grace_s)
