"""The planner's configuration: SLO targets, interval, predictor, per-pool bounds, the GPU budget
and cooldowns. Read from PDSERVE_PLANNER_* environment variables (the Helm chart sets them)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

PredictorName = Literal["constant", "ewma", "holt"]
PoolName = Literal["prefill", "decode"]
POOLS: tuple[PoolName, ...] = ("prefill", "decode")


class PlannerSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="PDSERVE_PLANNER_", frozen=True)

    ttft_target_s: float = Field(0.5, gt=0)
    itl_target_s: float = Field(0.05, gt=0)
    # A prefill worker is sized to this fraction of its profiled prompt tokens/s: the profile
    # times prompts alone, and the wait behind other prompts grows without bound as the busy
    # fraction nears 1 (an M/G/c queue). 0.6 keeps the 95th percentile wait of prompts with
    # ShareGPT's length spread (service time's squared coefficient of variation ~1.7) under
    # ~0.45 s at 0.06 s per prompt: 3 x mean wait, mean wait = rho / (1 - rho) x 1.36 x 0.06 s.
    prefill_utilization_target: float = Field(0.6, gt=0, le=1)
    interval_s: float = Field(60.0, gt=0)  # one observation and one decision per interval
    # Queued prompt tokens beyond what the prefill pool computes within the TTFT target are a
    # backlog that new arrivals wait behind: the pool is sized to drain it within this many
    # seconds on top of the arrival load (None: one interval, by when the next decision reads
    # the queue again and re-sizes for what is left).
    backlog_drain_s: float | None = Field(None, gt=0)
    # Between decisions, every this many seconds, the backlog is read alone; past the TTFT
    # target's worth it grows the prefill pool at once, from the arriving prompt tokens/s
    # (never shrinks it, never touches decode). 0: no check. It bounds how long a backlog
    # grows unseen; a start-up of minutes, not this, bounds the response.
    backlog_check_s: float = Field(5.0, ge=0)
    predictor: PredictorName = "holt"
    ewma_alpha: float = Field(0.5, gt=0, le=1)  # weight of the newest observation
    holt_alpha: float = Field(0.5, gt=0, le=1)  # level smoothing
    holt_beta: float = Field(0.3, gt=0, le=1)  # trend smoothing
    min_prefill: int = Field(1, ge=0)
    max_prefill: int = Field(8, ge=0)
    min_decode: int = Field(1, ge=0)
    max_decode: int = Field(8, ge=0)
    gpus_per_prefill: int = Field(1, ge=1)  # a worker's tensor-parallel size
    gpus_per_decode: int = Field(1, ge=1)
    gpu_budget: int = Field(16, ge=1)  # prefill and decode GPUs together
    # A pool grows at once (an SLO is at stake) but shrinks only this long after its last
    # change, so one quiet interval does not undo a scale-up that is still starting.
    scale_up_cooldown_s: float = Field(0.0, ge=0)
    scale_down_cooldown_s: float = Field(300.0, ge=0)
    # On a cluster (`pdserve planner`; the Helm chart sets these): the pools' Deployments, the
    # Prometheus server that scrapes the router and workers, the workers' profile (a JSON file,
    # planner/profile.py), and the port of the planner's own /metrics.
    namespace: str = ""
    prefill_deployment: str = ""
    decode_deployment: str = ""
    prometheus_url: str = ""
    profile_path: str = ""
    metrics_port: int = Field(9402, ge=1, le=65535)

    @model_validator(mode="after")
    def _bounds_fit(self) -> PlannerSettings:
        for pool in POOLS:
            low, high = self.bounds(pool)
            if low > high:
                raise ValueError(f"min_{pool}={low} > max_{pool}={high}")
        floor = self.min_prefill * self.gpus_per_prefill + self.min_decode * self.gpus_per_decode
        if floor > self.gpu_budget:
            raise ValueError(f"the pools' minimums need {floor} GPUs, over gpu_budget="
                             f"{self.gpu_budget}")  # fmt: skip
        return self

    @property
    def drain_s(self) -> float:
        return self.interval_s if self.backlog_drain_s is None else self.backlog_drain_s

    def bounds(self, pool: PoolName) -> tuple[int, int]:
        if pool == "prefill":
            return self.min_prefill, self.max_prefill
        return self.min_decode, self.max_decode

    def gpus_per_worker(self, pool: PoolName) -> int:
        return self.gpus_per_prefill if pool == "prefill" else self.gpus_per_decode
