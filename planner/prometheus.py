"""The load source on a cluster: the last interval's traffic and latency from a Prometheus
server that scrapes the router and the workers (the queries below)."""

from __future__ import annotations

import httpx

from planner.connector import (
    COUNTERS,
    DECODE_RUNNING,
    QUEUED_PROMPT_TOKENS,
    ConnectorError,
    LoadSource,
    Observation,
    PrefillFlow,
    observation,
)
from planner.settings import PoolName

# The backlog now; a gauge with no series yet (a router without admission queue) counts 0.
QUEUED = " + ".join(f"(sum({metric}) or vector(0))" for metric in QUEUED_PROMPT_TOKENS)
# {w}: the interval as a range.
QUERIES = {name: f"sum(increase({metric}[{{w}}]))" for name, metric in COUNTERS.items()} | {
    "decode_batch_per_worker": f"avg({DECODE_RUNNING})",
    "queued_prompt_tokens": QUEUED,
}
# The prompt tokens/s arriving: prefilled, plus the backlog's growth (each series' slope).
ARRIVING = " + ".join(
    [f"(sum(rate({COUNTERS['prompt_tokens']}[{{w}}])) or vector(0))"]
    + [f"(sum(deriv({metric}[{{w}}])) or vector(0))" for metric in QUEUED_PROMPT_TOKENS]
)
# Each pool's load per pod, for choosing the pods a scale-down removes.
POD_LOADS: dict[PoolName, str] = {
    "prefill": "sum by (pod) (pdserve_prefill_queued_tokens)",
    "decode": "sum by (pod) (pdserve_decode_running_requests)",
}


class PrometheusError(ConnectorError):
    """A query Prometheus did not answer."""


class PrometheusSource(LoadSource):
    def __init__(self, url: str, interval_s: float, client: httpx.Client | None = None) -> None:
        self.url = url.rstrip("/")
        self.interval_s = interval_s
        self.client = client or httpx.Client(timeout=10.0)

    def observe(self) -> Observation:
        window = f"{round(self.interval_s)}s"
        return observation(self.interval_s, {name: self._scalar(query.format(w=window))
                                             for name, query in QUERIES.items()})  # fmt: skip

    def prefill_flow(self) -> PrefillFlow:
        """The backlog now and the prompt tokens/s arriving over the last interval's window
        (Prometheus holds the history, so the reading does not depend on the last call; the
        window must hold at least two scrapes)."""
        window = f"{round(self.interval_s)}s"
        return PrefillFlow(self._scalar(QUEUED), self._scalar(ARRIVING.format(w=window)))

    def pod_loads(self, pool: PoolName) -> dict[str, float]:
        return {s["metric"]["pod"]: float(s["value"][1]) for s in self._query(POD_LOADS[pool])
                if "pod" in s["metric"]}  # fmt: skip

    def _scalar(self, query: str) -> float:
        """An empty answer (no series yet: nothing scraped, or no traffic) is 0."""
        result = self._query(query)
        return float(result[0]["value"][1]) if result else 0.0

    def _query(self, query: str) -> list[dict]:
        try:
            response = self.client.get(f"{self.url}/api/v1/query", params={"query": query})
            body = response.json()
        except (httpx.HTTPError, ValueError) as e:
            raise PrometheusError(f"{self.url}: {query}: {e}") from e
        if response.status_code != 200 or body.get("status") != "success":
            raise PrometheusError(f"{self.url}: {query}: HTTP {response.status_code} "
                                  f"{body.get('error', '')}")  # fmt: skip
        return body["data"]["result"]
