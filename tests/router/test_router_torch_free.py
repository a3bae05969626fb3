"""The router process never loads torch: tokenizing, chat templates and request validation
are torch-free modules, so a router starts in about a second and holds no model libraries."""

from __future__ import annotations

import subprocess
import sys
from importlib.util import find_spec
from pathlib import Path

import httpx
from router_harness import UpCluster

from pdserve.redis_server import free_port
from tests.waiting import wait_until


def _wait_serving(url: str, process: subprocess.Popen[bytes]) -> None:

    def serving() -> bool:
        assert process.poll() is None, f"router exited with {process.returncode}"
        try:
            return httpx.get(f"{url}/v1/models", timeout=2.0).status_code == 200
        except httpx.TransportError:
            return False

    wait_until(serving, timeout_s=120.0, interval_s=0.2, message=f"router at {url} did not serve")


def test_a_serving_router_has_no_torch_mapped(cluster: UpCluster) -> None:
    http_port = free_port()
    command = [
        sys.executable, "-m", "pdserve.cli", "router", "--redis-url", cluster.redis_url,
        "--host", "127.0.0.1", "--http-port", str(http_port), "--grpc-port", str(free_port()),
    ]  # fmt: skip
    process = subprocess.Popen(command)
    try:
        url = f"http://127.0.0.1:{http_port}"
        _wait_serving(url, process)
        completion = httpx.post(
            f"{url}/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2},
            timeout=120.0,
        )
        assert completion.status_code == 200, completion.text
        libraries = Path(f"/proc/{process.pid}/maps").read_text()
        assert "libtorch" not in libraries
        # torch's own folder, not any path with "torch" in it (a CUDA image's venv may live in
        # /opt/torch/.venv and numpy's libraries with it).
        assert str(Path(find_spec("torch").origin).parent) + "/" not in libraries
    finally:
        process.terminate()
        process.wait(timeout=30)
