"""How fast each worker's prefill budget really frees, as this router sees it.

A worker's own prefill speed (the registry's tokens/s) counts compute only; the budget a
request holds is freed at its first token, after the KV transfer and the decode worker's first
step as well. So the router measures the drain itself: prompt tokens whose prefill hold ended,
per second during which the worker held any of this router's prefills. The wait estimates use
the slower of the two speeds.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from router.workers import RoleViews, WorkerView

MIN_SAMPLE_TOKENS = 512  # fewer tokens per sample measure overheads, not the drain
SMOOTHING = 0.3  # weight of the newest sample
# Every finite float is an integer number of 2**-1074 (the smallest subnormal): speeds are
# summed as such integers, exactly.
EXACT_SHIFT = 1074


@dataclass(slots=True)
class DrainMeter:
    num_active: int = 0
    busy_since_s: float = 0.0
    tokens: int = 0  # released since the last sample
    busy_s: float = 0.0  # busy time since the last sample, closed spans only
    tokens_per_s: float = 0.0  # 0: not measured yet

    def started(self, now_s: float) -> None:
        if self.num_active == 0:
            self.busy_since_s = now_s
        self.num_active += 1

    def ended(self, num_tokens: int, now_s: float) -> None:
        self.num_active -= 1
        self.tokens += num_tokens
        busy_s = self.busy_s + now_s - self.busy_since_s
        if self.num_active == 0:
            self.busy_s = busy_s
        if self.tokens >= MIN_SAMPLE_TOKENS and busy_s > 0:
            sample = self.tokens / busy_s
            rate = self.tokens_per_s
            self.tokens_per_s = sample if rate == 0 else (1 - SMOOTHING) * rate + SMOOTHING * sample
            self.tokens, self.busy_s, self.busy_since_s = 0, 0.0, now_s


@dataclass(slots=True)
class DrainRates:
    _meters: dict[str, DrainMeter] = field(default_factory=dict)
    _pools: list[PoolSpeed] = field(default_factory=list)

    def started(self, worker_id: str, now_s: float) -> None:
        self._meters.setdefault(worker_id, DrainMeter()).started(now_s)

    def ended(self, worker_id: str, num_tokens: int, now_s: float) -> None:
        pools = [pool for pool in self._pools if worker_id in pool.reported]
        for pool in pools:
            pool.count(worker_id, -1)
        self._meters[worker_id].ended(num_tokens, now_s)
        for pool in pools:
            pool.count(worker_id, 1)

    def pool_speed(self, workers: RoleViews) -> float:
        """The sum of the workers' speeds."""
        return workers.index(self, self._new_pool).total()

    def _new_pool(self) -> PoolSpeed:
        pool = PoolSpeed(self)
        self._pools.append(pool)
        return pool

    def speed(self, worker_id: str, reported_tokens_per_s: float) -> float:
        """The slower of the worker's reported prefill speed and its measured drain."""
        meter = self._meters.get(worker_id)
        if meter is None or meter.tokens_per_s == 0:
            return reported_tokens_per_s
        return min(reported_tokens_per_s, meter.tokens_per_s)


@dataclass(slots=True)
class PoolSpeed:
    """One role's sum of DrainRates.speed over its workers, kept as their views and meters
    change. Summed exactly (in units of 2**-1074), so it never drifts: it is the correctly
    rounded sum of the speeds (math.fsum's), whatever the order of the changes."""

    drain: DrainRates
    reported: dict[str, float] = field(default_factory=dict)  # worker id -> its tokens/s
    _total: int = 0  # in units of 2**-EXACT_SHIFT

    def changed(self, old: WorkerView | None, new: WorkerView | None) -> None:
        if old is not None and new is not None and old.tokens_per_s == new.tokens_per_s:
            return  # its speed stands: most changes are to a worker's load alone
        if old is not None:
            self.count(old.worker_id, -1)
            del self.reported[old.worker_id]
        if new is not None:
            self.reported[new.worker_id] = new.tokens_per_s
            self.count(new.worker_id, 1)

    def count(self, worker_id: str, sign: int) -> None:
        numerator, denominator = self.drain.speed(
            worker_id, self.reported[worker_id]
        ).as_integer_ratio()
        # denominator is 2**k: the speed is numerator * 2**(EXACT_SHIFT - k) units
        self._total += sign * numerator << (EXACT_SHIFT - denominator.bit_length() + 1)

    def total(self) -> float:
        return self._total / (1 << EXACT_SHIFT)  # int / int is correctly rounded
