"""The sizing formulas: replicas per pool from the predicted load, the measured profile and the
SLO corrections; then the limits (per-pool bounds, the GPU budget, cooldowns)."""

from __future__ import annotations

import math

from planner.profile import Profile
from planner.settings import POOLS, PlannerSettings, PoolName

# Load x rate products such as 3 x 400 / 1200 land a hair above the integer in floats.
_CEIL_DIGITS = 9


def _ceil(x: float) -> int:
    return math.ceil(round(x, _CEIL_DIGITS))


def decode_context_tokens(prompt_tokens: float, output_tokens: float) -> float:
    """A decoding request's mean KV length over its life: the prompt plus half its output."""
    return prompt_tokens + output_tokens / 2


def prefill_workers(prompt_tokens_per_s: float, drain_tokens_per_s: float, prompt_tokens: float,
                    utilization_target: float, profile: Profile) -> int:  # fmt: skip
    """ceil(prompt tokens/s / (one worker's prefill tokens/s x the utilisation target)
    + backlog tokens/s to drain / one worker's prefill tokens/s). A worker draining a backlog
    is busy throughout, so that part needs no utilisation headroom; the arrivals' part does
    (the wait behind other prompts)."""
    if prompt_tokens_per_s <= 0 and drain_tokens_per_s <= 0:
        return 0
    speed = _prefill_speed(prompt_tokens, profile)
    return _ceil(prompt_tokens_per_s / (speed * utilization_target) + drain_tokens_per_s / speed)


def prefill_replicas(request_rate: float, prompt_tokens: float, correction: float,
                     utilization_target: float, profile: Profile,
                     drain_tokens_per_s: float = 0.0) -> int:  # fmt: skip
    """prefill_workers for rate x prompt tokens x min(1, correction). A correction above 1
    means TTFT is over the profile's because of queueing, which the load term (and the
    backlog's) already answers, so it never inflates the count (a burst would double it); one
    below 1 (prompts faster than profiled, e.g. prefix-cache hits) shrinks it."""
    demand = max(0.0, request_rate) * max(0.0, prompt_tokens) * min(1.0, correction)
    return prefill_workers(demand, drain_tokens_per_s, prompt_tokens, utilization_target,
                           profile)  # fmt: skip


def backlog_tokens(queued_prompt_tokens: float, workers: int, prompt_tokens: float,
                   ttft_target_s: float, profile: Profile) -> float:  # fmt: skip
    """The queued prompt tokens beyond what `workers` prefill within the TTFT target: a prompt
    arriving behind more than that waits past the target whatever the pool does next, so
    this is what must be drained; the queue a busy pool always holds is not."""
    within_target = workers * _prefill_speed(prompt_tokens, profile) * ttft_target_s
    return max(0.0, queued_prompt_tokens - within_target)


def _prefill_speed(prompt_tokens: float, profile: Profile) -> float:
    """One worker's prompt tokens/s at this mean length; with no length known yet (no
    traffic), at the shortest one profiled."""
    length = prompt_tokens if prompt_tokens > 0 else profile.prefill.prompt_tokens[0]
    return profile.prefill.tokens_per_s(length)


def decode_replicas(request_rate: float, prompt_tokens: float, output_tokens: float,
                    correction: float, itl_target_s: float, profile: Profile) -> int:  # fmt: skip
    """ceil(output tokens/s / the best tokens/s of one worker whose steps meet the ITL target
    divided by the correction, at the expected context). A correction above 1 (steps slower
    than the profile's) aims lower, so each worker carries fewer requests."""
    if request_rate <= 0 or output_tokens <= 0:
        return 0
    context = decode_context_tokens(prompt_tokens, output_tokens)
    per_worker = profile.decode.best_tokens_per_s(itl_target_s / correction, context)
    return _ceil(request_rate * output_tokens / per_worker)


def within_bounds(wanted: dict[PoolName, int], settings: PlannerSettings) -> dict[PoolName, int]:
    out: dict[PoolName, int] = {}
    for pool in POOLS:
        low, high = settings.bounds(pool)
        out[pool] = min(high, max(low, wanted[pool]))
    return out


def within_budget(wanted: dict[PoolName, int], settings: PlannerSettings) -> dict[PoolName, int]:
    """Over the GPU budget, both pools shrink in proportion (each kept at its minimum); the
    GPUs that rounding down leaves go back to prefill, then decode, up to what each wanted."""
    gpus = {pool: settings.gpus_per_worker(pool) for pool in POOLS}
    total = sum(wanted[pool] * gpus[pool] for pool in POOLS)
    if total <= settings.gpu_budget:
        return dict(wanted)
    scale = settings.gpu_budget / total
    out = {pool: max(settings.bounds(pool)[0], math.floor(wanted[pool] * scale)) for pool in POOLS}
    for pool in POOLS:
        spare = settings.gpu_budget - sum(out[p] * gpus[p] for p in POOLS)
        out[pool] = min(wanted[pool], out[pool] + spare // gpus[pool])
    return out


def after_cooldown(wanted: dict[PoolName, int], actual: dict[PoolName, int],
                   since_change_s: dict[PoolName, float],
                   settings: PlannerSettings) -> dict[PoolName, int]:  # fmt: skip
    """A pool changed too recently keeps its actual count."""
    out = dict(wanted)
    for pool in POOLS:
        cooldown_s = (settings.scale_up_cooldown_s if wanted[pool] > actual[pool]
                      else settings.scale_down_cooldown_s)  # fmt: skip
        if wanted[pool] != actual[pool] and since_change_s[pool] < cooldown_s:
            out[pool] = actual[pool]
    return out
