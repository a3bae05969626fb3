"""The router process: loads the tokenizer, follows the registry and the workers' prefix-cache
events, and serves HTTP (uvicorn) and gRPC on one asyncio loop, so admission needs no locks."""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
import ssl
from concurrent.futures import ThreadPoolExecutor

import redis
import uvicorn

from engine.model_files import resolve_model
from engine.tokenizer import TextTokenizer
from pdserve.registry import Registry
from router import metrics
from router.admission import Admission
from router.gateway import Gateway
from router.grpc_api.server import PublicGrpcServer
from router.heap import freeze_startup_heap
from router.http_api.app import create_app
from router.prefix_index import PrefixIndex
from router.prefix_index import follow as follow_prefixes
from router.replicas import ReplicaSync
from router.routing import build_policies
from router.settings import RouterSettings
from router.upstream import DecodeClient
from router.workers import WorkerPool

log = logging.getLogger(__name__)


class RouterServer:
    def __init__(self, settings: RouterSettings) -> None:
        self.settings = settings
        self.registry = Registry(settings.redis_url)
        self.pool = WorkerPool(settings.admission.default_prefill_tokens_per_s)
        self.prefixes = PrefixIndex()
        policies = build_policies(settings.routing, settings.admission, self.prefixes)
        self.admission = Admission(settings.admission, self.pool, policies, prefixes=self.prefixes)
        self.decode = DecodeClient(settings.worker_tls)
        self.replicas = ReplicaSync(self.pool, settings.redis_url, self.admission.dispatch)
        self.pool.on_assign = self.replicas.changed
        self.admission.before_send = self.replicas.hold
        self.gateway: Gateway | None = None
        self.http_port = 0
        self.grpc_port = 0
        self._grpc: PublicGrpcServer | None = None
        self._http: uvicorn.Server | None = None
        self._http_task: asyncio.Task[None] | None = None
        self._follow_task: asyncio.Task[None] | None = None
        self._prefix_task: asyncio.Task[None] | None = None
        self._replicas_task: asyncio.Task[None] | None = None

    async def start(self) -> RouterServer:
        settings = self.settings
        if settings.num_threads:
            asyncio.get_running_loop().set_default_executor(
                ThreadPoolExecutor(settings.num_threads, thread_name_prefix="tokenize")
            )
        model_dir = await asyncio.to_thread(resolve_model, settings.model)
        tokenizer = await asyncio.to_thread(TextTokenizer.load, model_dir)
        self.gateway = Gateway(settings, tokenizer, self.pool, self.admission, self.decode)
        self._grpc = PublicGrpcServer(self.gateway)
        if self._grpc.port == 0:
            raise OSError(f"cannot bind gRPC on {settings.host}:{settings.grpc_port}")
        self.grpc_port = self._grpc.port
        await self._grpc.start()
        await self._refresh()
        self._replicas_task = asyncio.create_task(self.replicas.run())
        self._follow_task = asyncio.create_task(self._follow_registry())
        self._prefix_task = asyncio.create_task(
            follow_prefixes(self.prefixes, settings.redis_url, self.pool.worker_ids)
        )
        await self._start_http()
        log.info("router serving HTTP on %s:%d and gRPC on %s:%d", settings.host,
                 self.http_port, settings.host, self.grpc_port)  # fmt: skip
        return self

    async def _start_http(self) -> None:
        settings = self.settings
        sock = socket.socket(socket.AF_INET6 if ":" in settings.host else socket.AF_INET)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((settings.host, settings.http_port))
        self.http_port = sock.getsockname()[1]
        tls = settings.tls
        config = uvicorn.Config(
            create_app(self.gateway), lifespan="off", access_log=False, log_level="warning",
            timeout_graceful_shutdown=int(settings.drain_grace_s),
            ssl_certfile=tls.cert_file, ssl_keyfile=tls.key_file, ssl_ca_certs=tls.ca_file,
            ssl_cert_reqs=ssl.CERT_REQUIRED if tls.ca_file else ssl.CERT_NONE,
        )  # fmt: skip
        self._http = uvicorn.Server(config)
        task = self._http_task = asyncio.create_task(self._http.serve(sockets=[sock]))
        while not self._http.started:
            if task.done():  # start-up failed (bad TLS files...): surface its error
                task.result()
                raise RuntimeError("HTTP server exited during start-up")
            await asyncio.sleep(0.01)

    async def _follow_registry(self) -> None:
        while True:
            await asyncio.sleep(self.settings.registry_refresh_s)
            await self._refresh()

    async def _refresh(self) -> None:
        try:
            await self.pool.refresh(self.registry)
        except redis.RedisError as e:  # keep routing on the last snapshot until Redis is back
            metrics.REGISTRY_REFRESH_FAILURES.inc()
            log.warning("registry refresh failed: %s", e)
        self.admission.dispatch()  # capacity may have changed
        ready = self.pool.serving()  # P + D pools, or aggregated workers
        assert self._grpc is not None
        await self._grpc.set_ready(ready)

    async def stop(self) -> None:
        """Stops taking requests, lets in-flight ones finish (up to drain_grace_s), closes."""
        if self._http is not None:
            self._http.should_exit = True
        if self._grpc is not None:
            await self._grpc.stop(self.settings.drain_grace_s)
        if self._http_task is not None:
            await self._http_task
        tasks = [
            t for t in (self._follow_task, self._prefix_task, self._replicas_task) if t is not None
        ]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self.decode.close()


async def serve(settings: RouterSettings) -> None:
    """Runs the router until SIGTERM or SIGINT."""
    server = await RouterServer(settings).start()
    freeze_startup_heap()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("stopping: draining in-flight requests")
    await server.stop()
