"""The load source on a cluster: the last interval's traffic and latency from a Prometheus
server that scrapes the router and the workers (the queries below)."""

from __future__ import annotations

import httpx

from planner.connector import ConnectorError, LoadSource, Observation
from planner.settings import PoolName

# {w}: the interval as a range. Requests are counted at their first token (the router's TTFT
# histogram), prompt tokens where they are prefilled, output tokens where they are streamed.
QUERIES = {
    "requests": "sum(increase(pdserve_router_ttft_seconds_count[{w}]))",
    "ttft_sum_s": "sum(increase(pdserve_router_ttft_seconds_sum[{w}]))",
    "itl_count": "sum(increase(pdserve_router_inter_token_latency_seconds_count[{w}]))",
    "itl_sum_s": "sum(increase(pdserve_router_inter_token_latency_seconds_sum[{w}]))",
    "prompt_tokens": "sum(increase(pdserve_prefill_prompt_tokens_total[{w}]))",
    "output_tokens": "sum(increase(pdserve_decode_output_tokens_total[{w}]))",
    "decode_batch_per_worker": "avg(pdserve_decode_running_requests)",
}
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
        """Per-request SLO attainment is not observed here: the histograms give TTFT and ITL
        means and counts, not each request's pair."""
        window = f"{round(self.interval_s)}s"
        v = {name: self._scalar(query.format(w=window)) for name, query in QUERIES.items()}
        requests = round(v["requests"])
        return Observation(
            interval_s=self.interval_s, num_requests=requests,
            prompt_tokens=v["prompt_tokens"] / requests if requests else 0.0,
            output_tokens=v["output_tokens"] / requests if requests else 0.0,
            ttft_s=v["ttft_sum_s"] / v["requests"] if v["requests"] else None,
            itl_s=v["itl_sum_s"] / v["itl_count"] if v["itl_count"] else None,
            decode_batch_per_worker=v["decode_batch_per_worker"],
        )  # fmt: skip

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
