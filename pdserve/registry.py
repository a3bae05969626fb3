"""The worker registry in Redis: each worker's role, addresses, capacity and live load, under a
key with a TTL that its heartbeat refreshes. A worker whose key expires is out of rotation."""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Literal

import redis

log = logging.getLogger(__name__)

# An aggregated worker is a decode worker that prefills locally (chunked prefill mixed into
# its continuous batch): the router sends it whole requests, no prefill worker involved.
Role = Literal["prefill", "decode", "aggregated"]
ROLES: tuple[Role, ...] = ("prefill", "decode", "aggregated")
KEY_PREFIX = "pdserve:workers"


@dataclass(frozen=True, slots=True)
class WorkerLoad:
    queued_tokens: int = 0
    running_requests: int = 0
    waiting_requests: int = 0
    free_blocks: int = 0
    total_blocks: int = 0
    prefill_tokens_per_s: float = 0.0
    # Seconds to load one token's KV from the worker's host tier, measured (0: no tier, or no
    # load yet): what the router's prefix index charges a tier hit.
    host_load_s_per_token: float = 0.0


@dataclass(frozen=True, slots=True)
class WorkerInfo:
    role: Role
    worker_id: str
    address: str  # host:port of the worker's gRPC server
    metrics_url: str
    kv_backend: str
    max_model_len: int
    chunk_size: int
    block_size: int  # tokens per KV block: what a KV headroom in blocks means
    load: WorkerLoad = field(default_factory=WorkerLoad)
    # Cross-worker prefix reuse (WorkerSettings.peer_fetch): a prefill worker reads the prefix
    # its decode worker holds, a decode worker lets it; False in an older worker's entry.
    peer_fetch: bool = False
    # Requests (sequences, for n > 1) it takes at once before refusing with RESOURCE_EXHAUSTED:
    # its --max-concurrent-rpcs, and for a decode worker its engine's max_num_seqs. The router
    # holds the rest in its queue. 0: no limit known (an older worker's entry).
    max_requests: int = 0
    updated_at: float = 0.0
    ttl_s: float = 0.0  # the entry's TTL when published: it is gone after updated_at + ttl_s

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, raw: str | bytes) -> WorkerInfo:
        """An entry of any version, as routers and workers mix during a rolling upgrade: a
        field this version lacks (a newer worker's) is ignored, and one the entry lacks (an
        older worker's) takes its default."""
        data = json.loads(raw)
        data["load"] = WorkerLoad(**_known_fields(WorkerLoad, data.get("load", {})))
        return cls(**_known_fields(cls, data))


def _known_fields(cls: type, data: dict) -> dict:
    names = {f.name for f in fields(cls)}
    return {name: value for name, value in data.items() if name in names}


def worker_key(role: str, worker_id: str) -> str:
    return f"{KEY_PREFIX}:{role}:{worker_id}"


class Registry:
    def __init__(self, redis_url: str) -> None:
        self.redis = redis.Redis.from_url(redis_url, socket_timeout=2.0)

    def publish(self, info: WorkerInfo, ttl_s: float) -> None:
        info = replace(info, updated_at=time.time(), ttl_s=ttl_s)
        self.redis.set(worker_key(info.role, info.worker_id), info.to_json(), px=int(ttl_s * 1000))

    def remove(self, role: Role, worker_id: str) -> None:
        self.redis.delete(worker_key(role, worker_id))

    def run_id(self) -> str:
        """The Redis server's run: a new one after a restart, which lost every entry."""
        return str(self.redis.info("server")["run_id"])

    def workers(self, role: Role) -> list[WorkerInfo]:
        keys = sorted(self.redis.scan_iter(match=f"{KEY_PREFIX}:{role}:*", count=500))
        if not keys:
            return []
        return [WorkerInfo.from_json(raw) for raw in self.redis.mget(keys) if raw is not None]


class Heartbeat:
    """Publishes a worker's entry every ttl/3 seconds until stopped; stop() removes it."""

    def __init__(
        self, registry: Registry, info: Callable[[], WorkerInfo], ttl_s: float = 6.0
    ) -> None:
        self.registry = registry
        self.info = info
        self.ttl_s = ttl_s
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="heartbeat", daemon=True)

    def start(self) -> Heartbeat:
        self.registry.publish(self.info(), self.ttl_s)  # fail loudly at start-up, not later
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stops publishing and removes the entry (idempotent)."""
        if self._stopped.is_set():
            return
        self._stopped.set()
        self._thread.join(timeout=5)
        info = self.info()
        self.registry.remove(info.role, info.worker_id)

    def _run(self) -> None:
        while not self._stopped.wait(self.ttl_s / 3):
            try:
                self.registry.publish(self.info(), self.ttl_s)
            except Exception as e:  # never let the thread die: a worker would vanish silently
                log.warning("registry heartbeat failed: %s", e)
