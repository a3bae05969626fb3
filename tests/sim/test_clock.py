"""The virtual-time loop: sleeps and asyncio.timeout run on simulated seconds, instantly."""

from __future__ import annotations

import asyncio

import pytest

from sim.clock import SimulationStalled, run_virtual


def test_sleeps_and_timeouts_advance_virtual_time_only():
    async def main():
        loop = asyncio.get_running_loop()
        await asyncio.sleep(1000.0)
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(5.0):
                await asyncio.sleep(60.0)
        order = []
        await asyncio.gather(*(_mark(order, t) for t in (3.0, 1.0, 2.0)))
        return loop.time(), order

    assert run_virtual(main()) == (1008.0, [1.0, 2.0, 3.0])


async def _mark(order: list[float], delay_s: float) -> None:
    await asyncio.sleep(delay_s)
    order.append(delay_s)


def test_a_coroutine_waiting_on_nothing_is_reported_not_hung():
    async def main():
        await asyncio.get_running_loop().create_future()

    with pytest.raises(SimulationStalled):
        run_virtual(main())
