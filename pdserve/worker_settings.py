"""What configures a worker process (torch-free: the CLI reads these defaults at import)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engine.config import EngineConfig
from pdserve.lengths import LengthBuckets
from pdserve.registry import Role
from pdserve.tls import TLSFiles

if TYPE_CHECKING:
    import kvtransfer  # its package loads the transfer backends


@dataclass(frozen=True, slots=True)
class WorkerSettings:
    role: Role
    worker_id: str
    redis_url: str
    host: str = "127.0.0.1"  # where the gRPC, metrics and tcp KV servers bind
    port: int = 0  # 0: the OS picks (tests); the CLI defaults to fixed ports
    advertise_host: str | None = None  # how peers reach us (the pod IP on Kubernetes)
    metrics_port: int = 0
    kv_backend: kvtransfer.Backend = "auto"
    registry_ttl_s: float = 6.0
    drain_grace_s: float = 30.0
    # Requests in flight at once (RPCs other than health and reflection); past it a caller gets
    # RESOURCE_EXHAUSTED at once instead of queueing silently behind the thread pool.
    max_concurrent_rpcs: int = 128
    warmup: bool = True
    # Cross-worker prefix reuse: a decode worker lets its prefill worker read the prefix it
    # already holds, and a prefill worker lacking it reads it when that beats computing it.
    peer_fetch: bool = True
    engine: EngineConfig = field(default_factory=EngineConfig)
    length_buckets: LengthBuckets = field(default_factory=LengthBuckets)
    # Serves gRPC with this cert (requiring client certs when a CA is set) and presents it when
    # calling peer workers. KV bytes themselves travel over NIXL/UCX or TCP, not over TLS.
    tls: TLSFiles = field(default_factory=TLSFiles)
