"""The planner on a local cluster (`pdserve up --planner`): the load read from the routers' and
the workers' own /metrics pages, the pools changed by starting workers and draining them."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import httpx
from prometheus_client.parser import text_string_to_metric_families

from pdserve.launcher import LocalCluster
from pdserve.registry import Registry, WorkerInfo
from planner.connector import (
    COUNTERS,
    DECODE_RUNNING,
    QUEUED_PROMPT_TOKENS,
    Connector,
    ConnectorError,
    LoadSource,
    Observation,
    PrefillFlow,
    observation,
)
from planner.planner import Planner
from planner.profile import Profile
from planner.settings import PlannerSettings, PoolName

log = logging.getLogger("pdserve.planner")


def scrape(url: str, names: set[str]) -> dict[str, float]:
    """Each named metric's samples on a /metrics page, summed over their labels."""
    try:
        text = httpx.get(url, timeout=5.0).text
    except httpx.HTTPError as e:
        raise ConnectorError(f"{url}: {e}") from e
    sums = dict.fromkeys(names, 0.0)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in sums:
                sums[sample.name] += sample.value
    return sums


class ScrapedSource(LoadSource):
    """The counters' increases since the last observation, page by page: a process that
    restarted (its counters back at 0) counts from 0, one that left counts no more. The
    backlog is the queue gauges' sum over the same pages."""

    def __init__(self, cluster: LocalCluster, interval_s: float,
                 clock: Callable[[], float] = time.monotonic) -> None:  # fmt: skip
        self.cluster = cluster
        self.interval_s = interval_s
        self.clock = clock
        self._last: dict[tuple[str, str], float] = {}  # (page, metric) -> value last read
        # prefill_flow's own readings: the prompt tokens counters, the backlog, the time
        self._flow_last: dict[tuple[str, str], float] = {}
        self._flow_read: tuple[float, float] | None = None  # (time, backlog)

    def observe(self) -> Observation:
        workers = self._workers()
        decode_pages = {w.metrics_url for w in workers if w.role == "decode"}
        pages = self._pages(workers)
        names = {*COUNTERS.values(), DECODE_RUNNING, *QUEUED_PROMPT_TOKENS}
        values = {page: scrape(page, names) for page in pages}
        increases = dict.fromkeys(COUNTERS, 0.0)
        for name, metric in COUNTERS.items():
            increases[name] = _increase(values, self._last, metric)
        self._last = {(page, m): v[m] for page, v in values.items() for m in COUNTERS.values()}
        running = [values[page][DECODE_RUNNING] for page in pages if page in decode_pages]
        increases["decode_batch_per_worker"] = sum(running) / len(running) if running else 0.0
        increases["queued_prompt_tokens"] = _queued(values)
        return observation(self.interval_s, increases)

    def prefill_flow(self) -> PrefillFlow:
        """The backlog now; arriving = (prompt tokens prefilled + the backlog's growth) / the
        time since the last call (the first call: 0/s)."""
        now_s = self.clock()
        metric = COUNTERS["prompt_tokens"]
        values = {page: scrape(page, {metric, *QUEUED_PROMPT_TOKENS})
                  for page in self._pages(self._workers())}  # fmt: skip
        queued = _queued(values)
        prefilled = _increase(values, self._flow_last, metric)
        last, self._flow_read = self._flow_read, (now_s, queued)
        self._flow_last = {(page, metric): v[metric] for page, v in values.items()}
        if last is None or now_s <= last[0]:
            return PrefillFlow(queued, 0.0)
        return PrefillFlow(queued, max(0.0, prefilled + queued - last[1]) / (now_s - last[0]))

    def _pages(self, workers: list[WorkerInfo]) -> list[str]:
        return [f"{router.http_url}/metrics" for router in self.cluster.routers] + [
            w.metrics_url for w in workers
        ]

    def _workers(self) -> list[WorkerInfo]:
        registry = Registry(self.cluster.redis_url)
        try:
            return registry.workers("prefill") + registry.workers("decode")
        except Exception as e:  # Redis restarting: this interval is skipped
            raise ConnectorError(f"registry: {e}") from e


def _increase(values: dict[str, dict[str, float]], last: dict[tuple[str, str], float],
              metric: str) -> float:  # fmt: skip
    """A counter's increase summed over the pages since `last`: a page whose counter fell
    (its process restarted) counts from 0, a page not read before counts whole."""
    total = 0.0
    for page, v in values.items():
        now, before = v[metric], last.get((page, metric), 0.0)
        total += now - before if now >= before else now
    return total


def _queued(values: dict[str, dict[str, float]]) -> float:
    return sum(v[metric] for v in values.values() for metric in QUEUED_PROMPT_TOKENS)


class LocalConnector(Connector):
    """Workers are started (LocalCluster.add_worker) or drained away (remove_worker), the
    least loaded first: a prefill worker by its queued prompt tokens, a decode worker by its
    running requests, as its registry entry reports them."""

    def __init__(self, cluster: LocalCluster) -> None:
        self.cluster = cluster

    def replicas(self) -> dict[PoolName, int]:
        return {pool: len(self.cluster.worker_names(pool)) for pool in ("prefill", "decode")}

    def set_replicas(self, pool: PoolName, count: int) -> None:
        names = self.cluster.worker_names(pool)
        try:
            for _ in range(count - len(names)):
                log.info("planner: starting %s", self.cluster.add_worker(pool))
        except RuntimeError as e:  # stopping
            raise ConnectorError(str(e)) from e
        for name in self._least_loaded(pool, names)[: max(0, len(names) - count)]:
            log.info("planner: draining %s", name)
            self.cluster.remove_worker(name)

    def _least_loaded(self, pool: PoolName, names: list[str]) -> list[str]:
        loads = {w.worker_id: w.load for w in Registry(self.cluster.redis_url).workers(pool)}

        def load(name: str) -> tuple[float, str]:
            reported = loads.get(name)
            if reported is None:  # still starting: it holds nothing
                return (-1.0, name)
            busy = reported.queued_tokens if pool == "prefill" else reported.running_requests
            return (float(busy), name)

        return sorted(names, key=load)


def start(cluster: LocalCluster, settings: PlannerSettings, profile: Profile) -> Planner:
    """The planner loop on a daemon thread (it ends with the launcher)."""
    source = ScrapedSource(cluster, settings.interval_s)
    source.observe()  # the counters so far: the first interval counts from here
    planner = Planner(settings, profile, source, LocalConnector(cluster))
    threading.Thread(target=planner.run_forever, name="planner", daemon=True).start()
    return planner
