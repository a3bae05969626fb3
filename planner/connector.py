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

    @property
    def request_rate(self) -> float:
        return self.num_requests / self.interval_s

    @property
    def slo_attainment(self) -> float | None:
        return self.num_met_slo / self.num_finished if self.num_finished else None


class LoadSource(ABC):
    @abstractmethod
    def observe(self) -> Observation:
        """The interval since the last call."""


class Connector(ABC):
    @abstractmethod
    def replicas(self) -> dict[PoolName, int]:
        """Each pool's replica count now, workers still starting included."""

    @abstractmethod
    def set_replicas(self, pool: PoolName, count: int) -> None:
        """Asks for count replicas; the pool reaches it in its own time."""
