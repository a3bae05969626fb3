"""CoreShare: the workers' steps and the host processes' work share the cores as processor
sharing, their rates changing whenever anything starts or ends (virtual time, so every end
time is exact)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import pytest

from sim.clock import run_virtual
from sim.costs import StepShape
from sim.worker import CoreShare

SHAPE = StepShape(num_prefill_tokens=64)


@dataclass(frozen=True)
class FixedCost:
    seconds: float

    def step_s(self, shape: StepShape) -> float:
        return self.seconds


def end_times(cores: CoreShare, steps: list[tuple[float, float]]) -> list[float]:
    """Each (start, alone seconds) step's end, run on the shared cores."""

    async def main() -> list[float]:
        loop = asyncio.get_running_loop()

        async def one(start_s: float, alone_s: float) -> float:
            await asyncio.sleep(start_s)
            await cores.run(SHAPE, alone_s)
            return loop.time()

        return list(await asyncio.gather(*(one(s, w) for s, w in steps)))

    return run_virtual(main())


def test_steps_beyond_the_cores_take_turns_and_speed_up_when_one_ends():
    # Three steps on two cores run at 2/3 each; once the short one ends (0.5 s of work at 2/3:
    # 0.75 s), the two left have a core each and finish their last 0.5 s at full speed.
    ends = end_times(CoreShare(2), [(0.0, 1.0), (0.0, 1.0), (0.0, 0.5)])
    assert ends == pytest.approx([1.25, 1.25, 0.75])
    assert CoreShare(2).num_busy == 0


def test_a_step_alone_runs_at_full_speed():
    assert end_times(CoreShare(2), [(0.0, 0.3), (1.0, 0.2)]) == pytest.approx([0.3, 1.2])


def test_a_neighbour_on_another_core_slows_a_step_by_the_calibrated_ratio_while_it_runs():
    # Beside a neighbour a step takes 1.25x as long (rate 0.8); the 0.4 s step ends at 0.5 s,
    # when the other has done 0.4 of its 1.0 and runs its last 0.6 alone.
    cores = CoreShare(2, beside=FixedCost(1.25), alone=FixedCost(1.0))
    assert end_times(cores, [(0.0, 1.0), (0.0, 0.4)]) == pytest.approx([1.1, 0.5])
    assert cores.slowdown(SHAPE) == pytest.approx(1.0)  # nothing running: the estimate is alone


def test_the_estimate_for_a_step_about_to_start_counts_the_steps_running_now():
    cores = CoreShare(2, beside=FixedCost(1.25), alone=FixedCost(1.0))

    async def main() -> tuple[float, float]:
        first = asyncio.ensure_future(cores.run(SHAPE, 1.0))
        second = asyncio.ensure_future(cores.run(SHAPE, 1.0))
        await asyncio.sleep(0.1)
        two = cores.slowdown(SHAPE)  # a third beside two: 2/3 of a core, and the neighbour
        await asyncio.gather(first, second)
        return two, cores.slowdown(SHAPE)

    two, none = run_virtual(main())
    assert two == pytest.approx(1.5 * 1.25)
    assert none == pytest.approx(1.0)


def step_and_burst_ends(cores: CoreShare, burst_at_s: float, alone_s: float) -> tuple[float, float]:
    """When a step of alone_s starting at 0 ends, and when the host processes' burst for a
    request arriving at burst_at_s beside it ends (request_arrived returns)."""

    async def main() -> tuple[float, float]:
        loop = asyncio.get_running_loop()

        async def arrive() -> float:
            await asyncio.sleep(burst_at_s)
            await cores.request_arrived()
            return loop.time()

        arrival = asyncio.ensure_future(arrive())
        await cores.run(SHAPE, alone_s)
        step_end = loop.time()
        return step_end, await arrival

    return run_virtual(main())


def test_a_request_s_host_work_holds_back_a_step_that_keeps_every_core_busy():
    # A 2-thread step and the 1-thread burst: 3 threads on 2 cores, 2/3 of a core each, but the
    # step's threads wait for each other, so it goes at the pace of the one sharing a core: 1/2.
    # The step has done 0.2 by the burst; the burst's 0.5 s takes 0.75 s, while the step does
    # 0.375 more; the last 0.425 runs alone: the step ends at 0.2 + 0.75 + 0.425.
    cores = CoreShare(2, threads_per_step=2, host_cpu_s_per_request=0.5)
    assert step_and_burst_ends(cores, 0.2, 1.0) == pytest.approx((1.375, 0.95))
    assert cores.num_busy == 0


def test_a_request_s_host_work_on_a_spare_core_leaves_a_single_thread_step_alone():
    cores = CoreShare(2, threads_per_step=1, host_cpu_s_per_request=0.5)
    assert step_and_burst_ends(cores, 0.2, 1.0) == pytest.approx((1.0, 0.7))


def test_the_estimate_for_a_step_about_to_start_counts_host_work_in_progress():
    cores = CoreShare(2, threads_per_step=2, host_cpu_s_per_request=0.5)

    async def main() -> tuple[float, float]:
        burst = asyncio.ensure_future(cores.request_arrived())
        await asyncio.sleep(0)  # the burst starts
        during = cores.slowdown(SHAPE)  # 2 threads beside the burst's one: half a core
        await burst  # alone: done after 0.5 s
        return during, cores.slowdown(SHAPE)

    during, after = run_virtual(main())
    assert during == pytest.approx(2.0)
    assert after == pytest.approx(1.0)


def test_streamed_tokens_host_work_runs_beside_a_step_and_nothing_waits_for_it():
    # One core: a 1 s step, and two tokens streamed at its start, 0.1 s of host work each.
    # Both take half the core until the 0.2 s burst ends at 0.4 s; the step's last 0.8 s then
    # runs alone.
    cores = CoreShare(1, host_cpu_s_per_token=0.1)

    async def main() -> float:
        step = asyncio.ensure_future(cores.run(SHAPE, 1.0))
        await asyncio.sleep(0)  # the step starts
        cores.tokens_streamed(2)
        await step
        return asyncio.get_running_loop().time()

    assert run_virtual(main()) == pytest.approx(1.2)
    assert cores.num_busy == 0
