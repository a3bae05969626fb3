"""The local connector's load source against real /metrics pages (prometheus_client's own
server on 127.0.0.1) and a real Redis registry: an interval's load is the counters' increases
over the routers' and the registered workers' pages."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from pdserve.redis_server import RedisServer, free_port
from pdserve.registry import Registry, WorkerInfo
from planner.local import ScrapedSource


@dataclass
class Page:
    """One process's /metrics page, served for real."""

    registry: CollectorRegistry = field(default_factory=CollectorRegistry)
    port: int = field(default_factory=free_port)

    def __post_init__(self) -> None:
        self.server, self.thread = start_http_server(self.port, "127.0.0.1", self.registry)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/metrics"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@dataclass
class Router:
    http_url: str


@dataclass
class Cluster:  # what the source reads of a LocalCluster
    routers: list[Router]
    redis_url: str


def entry(role: str, worker_id: str, metrics_url: str) -> WorkerInfo:
    return WorkerInfo(role=role, worker_id=worker_id, address="127.0.0.1:1",  # type: ignore[arg-type]
                      metrics_url=metrics_url, kv_backend="tcp", max_model_len=2048,
                      chunk_size=512, block_size=16)  # fmt: skip


@pytest.fixture
def pages():
    made: list[Page] = []

    def make() -> Page:
        made.append(Page())
        return made[-1]

    yield make
    for page in made:
        page.close()


def test_an_interval_is_the_counters_increases_across_the_pages(pages):
    router, prefill, decode = pages(), pages(), pages()
    ttft = Histogram("pdserve_router_ttft_seconds", "", registry=router.registry)
    itl = Histogram("pdserve_router_inter_token_latency_seconds", "", registry=router.registry)
    prompt = Counter("pdserve_prefill_prompt_tokens", "", ["source"], registry=prefill.registry)
    output = Counter("pdserve_decode_output_tokens", "", registry=decode.registry)
    running = Gauge("pdserve_decode_running_requests", "", registry=decode.registry)
    with RedisServer() as redis_server:
        registry = Registry(redis_server.url)
        registry.publish(entry("prefill", "prefill-0", prefill.url), ttl_s=60)
        registry.publish(entry("decode", "decode-0", decode.url), ttl_s=60)
        source = ScrapedSource(
            Cluster([Router(router.url.removesuffix("/metrics"))], redis_server.url), 10.0
        )
        ttft.observe(9.0)  # before the first observation: not this interval's
        prompt.labels("computed").inc(1000)
        source.observe()
        for seconds in (0.5, 1.5):
            ttft.observe(seconds)
        for seconds in (0.1, 0.2, 0.3):
            itl.observe(seconds)
        prompt.labels("computed").inc(300)
        prompt.labels("prefix_cache").inc(100)  # every source of a prompt token counts
        output.inc(64)
        running.set(3)
        first = source.observe()
        assert (first.num_requests, first.prompt_tokens, first.output_tokens) == (2, 200.0, 32.0)
        assert first.ttft_s == pytest.approx(1.0)
        assert first.itl_s == pytest.approx(0.2)
        assert (first.interval_s, first.decode_batch_per_worker) == (10.0, 3.0)
        # The decode worker restarted (its counter starts again from 0) and a second prefill
        # worker joined (its tokens so far count whole).
        decode.close()
        restarted = pages()
        Counter("pdserve_decode_output_tokens", "", registry=restarted.registry).inc(8)
        Gauge("pdserve_decode_running_requests", "", registry=restarted.registry).set(1)
        registry.publish(entry("decode", "decode-0", restarted.url), ttl_s=60)
        joined = pages()
        Counter("pdserve_prefill_prompt_tokens", "", ["source"],
                registry=joined.registry).labels("computed").inc(50)  # fmt: skip
        registry.publish(entry("prefill", "prefill-1", joined.url), ttl_s=60)
        ttft.observe(2.0)
        second = source.observe()
        assert (second.num_requests, second.prompt_tokens, second.output_tokens) == (1, 50.0, 8.0)
        assert second.itl_s is None and second.decode_batch_per_worker == 1.0
        assert second.ttft_s == pytest.approx(2.0)


def test_the_backlog_and_the_arriving_prompt_tokens_from_the_pages(pages):
    router, prefill = pages(), pages()
    in_router = Gauge("pdserve_router_queued_prompt_tokens", "", registry=router.registry)
    in_worker = Gauge("pdserve_prefill_queued_tokens", "", registry=prefill.registry)
    prompt = Counter("pdserve_prefill_prompt_tokens", "", ["source"], registry=prefill.registry)
    now = [100.0]
    with RedisServer() as redis_server:
        Registry(redis_server.url).publish(entry("prefill", "prefill-0", prefill.url), ttl_s=60)
        source = ScrapedSource(
            Cluster([Router(router.url.removesuffix("/metrics"))], redis_server.url), 10.0,
            clock=lambda: now[0],
        )  # fmt: skip
        in_router.set(600)
        in_worker.set(400)
        prompt.labels("computed").inc(5000)
        first = source.prefill_flow()  # starts the measure
        assert (first.queued_prompt_tokens, first.arriving_tokens_per_s) == (1000.0, 0.0)
        # 2 s later: 3,000 prompt tokens prefilled and the backlog grew by 1,000, so 4,000
        # arrived: 2,000/s.
        now[0] = 102.0
        prompt.labels("computed").inc(3000)
        in_router.set(1500)
        in_worker.set(500)
        second = source.prefill_flow()
        assert (second.queued_prompt_tokens, second.arriving_tokens_per_s) == (2000.0, 2000.0)
        assert source.observe().queued_prompt_tokens == 2000.0
