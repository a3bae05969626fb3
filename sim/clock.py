"""Virtual time: an asyncio event loop whose clock jumps to the next timer instead of sleeping,
so the router's own coroutines (Admission.admit, asyncio.timeout) run unchanged on it."""

from __future__ import annotations

import asyncio
import selectors
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


class SimulationStalled(RuntimeError):
    """Nothing is ready and no timer is pending, but the simulation has not finished."""


class _VirtualSelector(selectors.SelectSelector):
    """select(timeout) advances the virtual clock by timeout and returns at once; the loop
    then runs the timers that became due. timeout None means nothing can ever wake up."""

    def __init__(self) -> None:
        super().__init__()
        self.now_s = 0.0

    def select(self, timeout: float | None = None):  # type: ignore[override]
        if timeout is None:
            raise SimulationStalled("no callback is ready and no timer is pending")
        if timeout > 0:
            self.now_s += timeout
        return super().select(0)  # the loop's self-pipe only; never blocks


class VirtualTimeLoop(asyncio.SelectorEventLoop):
    """loop.time() is simulated seconds since the start; wall time does not pass in sleeps."""

    def __init__(self) -> None:
        self._virtual = _VirtualSelector()
        super().__init__(self._virtual)

    def time(self) -> float:
        return self._virtual.now_s


def run_virtual(main: Coroutine[Any, Any, T]) -> T:
    """Runs main on a fresh virtual-time loop and closes it (like asyncio.run)."""
    loop = VirtualTimeLoop()
    try:
        return loop.run_until_complete(main)
    finally:
        # As asyncio.run: what a failed run left pending is cancelled, not leaked.
        pending = asyncio.all_tasks(loop)
        for task in pending:
            task.cancel()
        if pending:
            loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
        loop.run_until_complete(loop.shutdown_asyncgens())
        loop.close()
