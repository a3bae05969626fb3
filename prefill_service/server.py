"""Starts a prefill worker: engine, KV agent, the Prefill service, registry entry."""

from __future__ import annotations

from pdserve.worker.v1 import worker_pb2, worker_pb2_grpc
from pdserve.worker_runtime import WorkerRuntime
from pdserve.worker_settings import WorkerSettings
from prefill_service.service import PrefillService

SERVICE_NAME = worker_pb2.DESCRIPTOR.services_by_name["Prefill"].full_name


def start(settings: WorkerSettings) -> WorkerRuntime:
    runtime = WorkerRuntime(settings)
    service = PrefillService(runtime)
    return runtime.start([(worker_pb2_grpc.add_PrefillServicer_to_server, service, SERVICE_NAME)])
