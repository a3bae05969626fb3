"""Starts a decode worker: engine, KV agent, the Decode service, registry entry."""

from __future__ import annotations

from decode_service.service import DecodeService
from decode_service.settings import DecodeSettings
from pdserve.worker.v1 import worker_pb2, worker_pb2_grpc
from pdserve.worker_runtime import WorkerRuntime
from pdserve.worker_settings import WorkerSettings

SERVICE_NAME = worker_pb2.DESCRIPTOR.services_by_name["Decode"].full_name


def start(settings: WorkerSettings, decode: DecodeSettings | None = None) -> WorkerRuntime:
    runtime = WorkerRuntime(settings)
    service = DecodeService(runtime, decode)
    return runtime.start([(worker_pb2_grpc.add_DecodeServicer_to_server, service, SERVICE_NAME)])
