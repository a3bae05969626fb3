"""The router tests' cluster: `pdserve up` exactly as a user runs it (Redis, one prefill and
one decode worker with a thread each, the router), stopped with Ctrl-C at the end."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import pytest
from router_harness import InProcessRouter

from pdserve.redis_server import free_port
from router.settings import RouterSettings


@dataclass(frozen=True, slots=True)
class Cluster:
    http_url: str
    grpc_address: str
    redis_url: str


@pytest.fixture(scope="session")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    http_port, grpc_port = free_port(), free_port()
    command = [
        sys.executable, "-m", "pdserve.cli", "up", "--http-port", str(http_port),
        "--grpc-port", str(grpc_port), "--no-warmup", "--kv-backend", "tcp", "--cores", "2",
        "--log-dir", str(tmp_path_factory.mktemp("pdserve-up")),
    ]  # fmt: skip
    up = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    banner = []
    for line in up.stdout:  # ends when `up` exits, so a failed start cannot hang here
        banner.append(line)
        if line.startswith("Ctrl-C stops everything"):
            break
    text = "".join(banner)
    assert "pdserve is up" in text, text
    redis_url = re.search(r"Redis\s+(\S+)", text).group(1)
    yield Cluster(f"http://127.0.0.1:{http_port}", f"127.0.0.1:{grpc_port}", redis_url)
    up.send_signal(signal.SIGINT)
    rest, _ = up.communicate(timeout=90)
    assert up.returncode == 0, rest
    assert rest.strip().endswith("stopped."), rest


@pytest.fixture
def start_router(cluster: Cluster) -> Iterator[Callable[..., InProcessRouter]]:
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
