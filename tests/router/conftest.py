"""The router tests' cluster: `pdserve up` exactly as a user runs it (Redis, one prefill and
one decode worker with a thread each, the router) but for the workers' fp32 weights, stopped
with Ctrl-C at the end."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
from router_harness import InProcessRouter, UpCluster, pdserve_up

from pdserve.redis_server import free_port
from router.settings import RouterSettings


@pytest.fixture(scope="session")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[UpCluster]:
    http_port, grpc_port = free_port(), free_port()
    with pdserve_up(
        "--http-port", str(http_port), "--grpc-port", str(grpc_port), "--no-warmup",
        "--kv-backend", "tcp", "--cores", "2",
        "--log-dir", str(tmp_path_factory.mktemp("pdserve-up")),
        env={"PDSERVE_QUANTIZATION": "none"},  # the fp32 path: tests compare with the llm fixture
    ) as (_, redis_url):  # fmt: skip
        yield UpCluster(f"http://127.0.0.1:{http_port}", f"127.0.0.1:{grpc_port}", redis_url)


@pytest.fixture
def start_router(cluster: UpCluster) -> Iterator[Callable[..., InProcessRouter]]:
    """Routers with a test's own settings, in this process, on the same workers."""
    routers: list[InProcessRouter] = []

    def start(**settings: object) -> InProcessRouter:
        config = RouterSettings(redis_url=cluster.redis_url, http_port=0, grpc_port=0,
                                **settings)  # type: ignore[arg-type]  # fmt: skip
        routers.append(InProcessRouter(config))
        return routers[-1]

    yield start
    for router in routers:
        router.stop()
