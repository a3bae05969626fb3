"""A cluster across separate hosts: Redis, the router and each worker on its own host (a network
namespace of pdserve.netns, joined through a bridge); skipped where namespaces cannot be made."""

from __future__ import annotations

from collections.abc import Iterator
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
