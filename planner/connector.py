"""What the planner reads and changes: a load source (the last interval's traffic and latency)
and a connector (each pool's replica count). The simulator and Kubernetes implement them."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

from planner.settings import PoolName


class ConnectorError(RuntimeError):
    """A load source or connector that could not do its part this interval (the API or the
    metrics server refused or was unreachable); the planner logs it and tries next interval."""


@dataclass(frozen=True, slots=True)
class Observation:
    """One interval's traffic and latency. TTFT and ITL are means over the requests whose first
    token (TTFT) or last token (ITL) came in the interval; None when none did."""

    interval_s: float
    num_requests: int  # arrived in the interval
    prompt_tokens: float  # mean over those requests (0 if none)
    output_tokens: float
    ttft_s: float | None
    itl_s: float | None
    decode_batch_per_worker: float  # mean running requests per decode worker
    num_finished: int = 0  # requests that ended in the interval
    num_met_slo: int = 0  # of those, the ones within both TTFT and ITL targets
    # Prompt tokens waiting for or in prefill at the interval's end (the router's admission
    # queue and the prefill workers'): the backlog the arrival rate alone does not show.
    queued_prompt_tokens: float = 0.0

    @property
    def request_rate(self) -> float:
        return self.num_requests / self.interval_s

    @property
    def slo_attainment(self) -> float | None:
        return self.num_met_slo / self.num_finished if self.num_finished else None


# The counters an interval's load is the increase of, summed over their series: requests are
# counted at their first token (the router's TTFT histogram), prompt tokens where they are
# prefilled, output tokens where they are streamed. Every load source reads these.
COUNTERS = {
    "requests": "pdserve_router_ttft_seconds_count",
    "ttft_sum_s": "pdserve_router_ttft_seconds_sum",
    "itl_count": "pdserve_router_inter_token_latency_seconds_count",
    "itl_sum_s": "pdserve_router_inter_token_latency_seconds_sum",
    "prompt_tokens": "pdserve_prefill_prompt_tokens_total",
    "output_tokens": "pdserve_decode_output_tokens_total",
}
DECODE_RUNNING = "pdserve_decode_running_requests"  # a gauge, averaged over decode workers
# The prefill backlog, summed: prompt tokens in the routers' admission queues (which hold what
# is over each prefill worker's token budget) and in the prefill workers (waiting or computing).
QUEUED_PROMPT_TOKENS = ("pdserve_router_queued_prompt_tokens", "pdserve_prefill_queued_tokens")


@dataclass(frozen=True, slots=True)
class PrefillFlow:
    """The prefill backlog now and the prompt tokens per second arriving lately. While prompts
    queue, what arrives is what was prefilled plus what the queue grew by, so a source measures
    it as (prompt tokens prefilled + the queue's growth) / the time since its last reading, or
    over a window of its history where it keeps one (Prometheus)."""

    queued_prompt_tokens: float
    arriving_tokens_per_s: float


def observation(interval_s: float, v: dict[str, float]) -> Observation:
    """An interval's Observation from the counters' increases (COUNTERS' names),
    "decode_batch_per_worker" and "queued_prompt_tokens" (QUEUED_PROMPT_TOKENS summed; 0 if
    absent). Per-request SLO attainment is not observed this way: the histograms give TTFT
    and ITL means and counts, not each request's pair."""
    requests = round(v["requests"])
    return Observation(
        interval_s=interval_s, num_requests=requests,
        prompt_tokens=v["prompt_tokens"] / requests if requests else 0.0,
        output_tokens=v["output_tokens"] / requests if requests else 0.0,
        ttft_s=v["ttft_sum_s"] / v["requests"] if v["requests"] else None,
        itl_s=v["itl_sum_s"] / v["itl_count"] if v["itl_count"] else None,
        decode_batch_per_worker=v["decode_batch_per_worker"],
        queued_prompt_tokens=v.get("queued_prompt_tokens", 0.0),
    )  # fmt: skip


class LoadSource(ABC):
    @abstractmethod
    def observe(self) -> Observation:
        """The interval since the last call."""

    def prefill_flow(self) -> PrefillFlow | None:
        """The backlog now and the arriving prompt tokens/s lately (PrefillFlow), read between
        intervals for the planner's backlog check; None where the source cannot tell (then
        there is no check)."""
        return None


class Connector(ABC):
    @abstractmethod
    def replicas(self) -> dict[PoolName, int]:
        """Each pool's replica count now, workers still starting included."""

    @abstractmethod
    def set_replicas(self, pool: PoolName, count: int) -> None:
        """Asks for count replicas; the pool reaches it in its own time."""
