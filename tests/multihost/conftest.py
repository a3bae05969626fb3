"""A cluster across separate hosts: Redis, the router and each worker on its own host (a network
namespace of pdserve.netns, joined through a bridge); skipped where namespaces cannot be made."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import grpc
import pytest

from engine import SamplingParams
from pdserve.netns import Host, NamespacesUnavailableError, Network
from pdserve.redis_server import RedisServer
from pdserve.v1 import generation_pb2 as pb
from pdserve.v1 import generation_pb2_grpc
from tests.cluster import Cluster, RouterProcess, WorkerProcess
from tests.waiting import wait_until
from tests.workers.calls import LONG

# Four prefill chunks of 512 tokens: after the first one ships, a fault has the next three
# chunks' compute to land in (seconds on one thread) while the KV is on the wire.
CHUNKED_PROMPT = LONG[:1600]


@dataclass(frozen=True, slots=True)
class Hosts:
    network: Network
    cluster: Cluster
    router: RouterProcess

    @property
    def redis(self) -> Host:
        return self.network.hosts[0]

    def live(self, role: str) -> list[WorkerProcess]:
        return [w for w in self.cluster.workers if w.role == role and w.process.poll() is None]


@contextmanager
def cluster_on_hosts(
    kv_backend: str, num_prefill: int, num_decode: int, *router_args: str
) -> Iterator[Hosts]:
    """Redis, the workers and a router, each on a host of a new network, all removed after."""
    try:
        network = Network()
    except NamespacesUnavailableError as e:
        pytest.skip(f"separate hosts need network namespaces here: {e}")
    with network:
        redis_host = network.host("redis")
        redis = RedisServer(redis_host.address, 6379, launcher=redis_host.command([]))
        cluster = Cluster(kv_backend=kv_backend, redis=redis)
        try:
            for role, count in (("prefill", num_prefill), ("decode", num_decode)):
                for i in range(count):
                    cluster.start(role, wait=False, host=network.host(f"{role}{i}"))
            cluster.wait_all_registered()
            router = cluster.start_router(network.host("router"), *router_args)
            yield Hosts(network, cluster, router)
        finally:
            cluster.stop()


def host_of(worker: WorkerProcess) -> Host:
    assert worker.host is not None
    return worker.host


def generate(router: RouterProcess, prompt: str | list[int], max_tokens: int):
    """A greedy Generate call through the router; its messages."""
    stub = generation_pb2_grpc.GenerationStub(grpc.insecure_channel(router.grpc_address))
    params = pb.SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    request = (
        pb.GenerateRequest(text=prompt, params=params)
        if isinstance(prompt, str)
        else pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt), params=params)
    )
    return list(stub.Generate(request, timeout=300))


def greedy_tokens(llm, prompts: list, max_tokens: int) -> list[list[int]]:
    """What the single-process engine generates: the tokens every run must match."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    return [output.token_ids for output in llm.generate(prompts, params)]


def token_ids(messages) -> list[int]:
    return [t for m in messages for t in m.token_ids]


class WhenTransferring(threading.Thread):
    """Does `act` to the prefill worker whose KV is on the wire: a first chunk sent while the
    prompt's later chunks are still being computed. join() re-raises a failure to see that
    moment (a fault that lands late proves nothing)."""

    def __init__(self, hosts: Hosts, act: Callable[[WorkerProcess], None]) -> None:
        super().__init__(name="when-transferring")
        self.hosts, self.act, self.failure = hosts, act, None
        self.sent_before = {p.worker_id: self.sent(p) for p in hosts.live("prefill")}

    def sent(self, prefill: WorkerProcess) -> float:
        return prefill.metric("pdserve_kv_transfer_bytes_total",
                              backend=self.hosts.cluster.kv_backend, direction="sent")  # fmt: skip

    def transferring(self) -> WorkerProcess | None:
        for prefill in self.hosts.live("prefill"):
            if self.sent(prefill) > self.sent_before[prefill.worker_id] and (
                prefill.metric("pdserve_prefill_queued_tokens") > 0
            ):
                return prefill
        return None

    def run(self) -> None:
        try:
            self.act(wait_until(
                self.transferring, timeout_s=120, interval_s=0.02,
                message="no prefill worker seen mid-transfer",
            ))  # fmt: skip
        except BaseException as e:  # noqa: BLE001 - handed to the test's thread by join()
            self.failure = e

    def join(self, timeout: float | None = None) -> None:
        super().join(timeout)
        if self.failure is not None:
            raise self.failure
