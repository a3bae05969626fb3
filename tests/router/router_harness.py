"""Helpers for the router tests: worker records for the pure tests, an in-process router on
its own event loop thread for the cluster tests."""

from __future__ import annotations

import asyncio
import itertools
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace

import httpx
import torch

from pdserve.registry import Registry, WorkerInfo, WorkerLoad
from router.server import RouterServer
from router.settings import RouterSettings
from router.ticket import Ticket, affinity_key, kv_blocks_held
from router.workers import WorkerPool
from tests.waiting import wait_until

MODEL = "smollm2-135m"


def wait_for_decode_load(cluster, running: int, timeout_s: float = 60.0) -> WorkerLoad:
    """The decode worker's load from a heartbeat sent after this call, once it shows `running`
    requests (registry numbers lag by up to a heartbeat: older ones prove nothing)."""
    registry, since = Registry(cluster.redis_url), time.time()

    def fresh() -> WorkerLoad | None:
        (decode,) = registry.workers("decode")
        if decode.updated_at > since and decode.load.running_requests == running:
            return decode.load
        return None

    return wait_until(
        fresh, timeout_s=timeout_s, interval_s=0.1,
        message=f"decode worker never showed {running} running",
    )  # fmt: skip


def routed_decode_requests(cluster) -> int:
    workers = httpx.get(f"{cluster.http_url}/admin/workers", timeout=10).json()["workers"]
    (decode,) = [w for w in workers if w["role"] == "decode"]
    return decode["assigned_here"]["requests"]


def assert_cancelled_downstream(cluster) -> None:
    """The decode worker runs nothing and holds no KV block; the router routes nothing there."""
    idle = wait_for_decode_load(cluster, running=0)
    assert idle.free_blocks == idle.total_blocks  # every KV block is back
    assert routed_decode_requests(cluster) == 0


def worker(
    role: str, worker_id: str, *, tokens_per_s: float = 0.0, queued_tokens: int = 0,
    running: int = 0, free_blocks: int = 1024, total_blocks: int = 1024,
    max_model_len: int = 8192, updated_at: float = 0.0,
) -> WorkerInfo:  # fmt: skip
    load = WorkerLoad(
        queued_tokens=queued_tokens, running_requests=running, free_blocks=free_blocks,
        total_blocks=total_blocks, prefill_tokens_per_s=tokens_per_s,
    )  # fmt: skip
    return WorkerInfo(
        role=role, worker_id=worker_id, address=f"{worker_id}:1", metrics_url="",
        kv_backend="tcp", max_model_len=max_model_len, chunk_size=512, block_size=16, load=load,
        updated_at=updated_at,
    )  # fmt: skip


def ticket(
    request_id: str, num_prompt_tokens: int, *, arrival_s: float = 0.0, max_tokens: int = 16,
    bucket: str | None = None, prompt: list[int] | None = None, num_seqs: int = 1,
) -> Ticket:  # fmt: skip
    from pdserve.lengths import LengthBuckets

    return Ticket(
        request_id=request_id,
        num_prompt_tokens=num_prompt_tokens,
        max_tokens=max_tokens,
        num_kv_blocks=kv_blocks_held(num_prompt_tokens, max_tokens, 16, num_seqs),
        bucket=bucket or LengthBuckets().of(num_prompt_tokens),  # type: ignore[arg-type]
        arrival_s=arrival_s,
        affinity_key=affinity_key(prompt or [num_prompt_tokens]),
        block_size=16,
        num_seqs=num_seqs,
    )


def pool_of(*infos: WorkerInfo, default_tokens_per_s: float = 500.0) -> WorkerPool:
    pool = WorkerPool(default_tokens_per_s)
    for role in ("prefill", "decode"):
        pool.update(role, [i for i in infos if i.role == role])
    return pool


def with_load(info: WorkerInfo, **load: object) -> WorkerInfo:
    return replace(info, load=replace(info.load, **load))


@contextmanager
def one_torch_thread() -> Iterator[None]:
    """For reference generations next to running workers: with two threads on two busy cores,
    each op waits for a descheduled thread, and a batch takes 20x longer."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


class InProcessRouter:
    """A RouterServer on its own loop thread, so a test can call it with blocking clients."""

    def __init__(self, settings: RouterSettings) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()
        self.server = self.call(RouterServer(settings).start())

    def call(self, coroutine):
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout=120)

    @property
    def http_url(self) -> str:
        return f"http://127.0.0.1:{self.server.http_port}"

    @property
    def grpc_address(self) -> str:
        return f"127.0.0.1:{self.server.grpc_port}"

    def stop(self) -> None:
        self.call(self.server.stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=10)


def spanning_stop(pieces: list[str], num_tokens: int, from_token: int = 0) -> tuple[str, int, int]:
    """From a greedy run's per-token text pieces: a stop string that starts inside one token's
    text (from_token or later) and ends inside the text of the token num_tokens - 1 later, and
    occurs first there. Returns (stop, its start in the text, the index of the token that
    completes it)."""
    text = "".join(pieces)
    ends = list(itertools.accumulate(len(p) for p in pieces))
    for first in range(from_token, len(pieces) - num_tokens + 1):
        span = pieces[first : first + num_tokens]
        if len(span[0]) < 2 or len(span[-1]) < 2 or not all(span):
            continue
        start = ends[first] - 1  # the first token's last character ... the last one's first
        stop = text[start : ends[first + num_tokens - 2] + 1]
        if text.find(stop) == start:
            return stop, start, first + num_tokens - 1
    raise AssertionError(f"no stop string spans {num_tokens} tokens of {pieces}")


class Clock:
    """A clock the test moves by hand (Admission and Ledger take one)."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@dataclass(frozen=True, slots=True)
class UpCluster:
    """Where the shared `pdserve up` cluster answers."""

    http_url: str
    grpc_address: str
    redis_url: str


@contextmanager
def pdserve_up(*args: str, env: dict[str, str] | None = None) -> Iterator[tuple[str, str]]:
    """`pdserve up ARGS` exactly as a user runs it, stopped with Ctrl-C at the end (which must
    exit 0): yields its start-up banner and the Redis URL the banner names."""
    command = [sys.executable, "-m", "pdserve.cli", "up", *args]
    environment = None if env is None else os.environ | env
    process = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=environment
    )
    banner = []
    for line in process.stdout:  # ends when `up` exits, so a failed start cannot hang here
        banner.append(line)
        if line.startswith("Ctrl-C stops everything"):
            break
    text = "".join(banner)
    match = re.search(r"Redis\s+(\S+)", text)
    assert "pdserve is up" in text and match, text
    yield text, match.group(1)
    process.send_signal(signal.SIGINT)
    rest, _ = process.communicate(timeout=90)
    assert process.returncode == 0, rest
    assert rest.strip().endswith("stopped."), rest
