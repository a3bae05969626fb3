"""The one poll-until helper of the tests: wait for a condition, never for a length of time.

A test that needs something to have happened (a worker registered, a key expired, a transfer
started) polls for it with a generous deadline instead of sleeping: the deadline only bounds a
hang, it is never what the test asserts, so a host twice as slow passes the same way."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def wait_until(
    condition: Callable[[], T | None],
    *,
    timeout_s: float,
    message: str | Callable[[], str],
    interval_s: float = 0.05,
) -> T:
    """Calls condition() every interval_s until it returns something truthy, and returns that.

    Past timeout_s it raises AssertionError(message) (message may be a callable, called then,
    to describe the state reached). The condition is called once more at the deadline, so a
    slow poll never loses its last chance; exceptions it raises propagate."""
    deadline = time.monotonic() + timeout_s
    while True:
        last_chance = time.monotonic() >= deadline
        if result := condition():
            return result
        if last_chance:
            raise _timed_out(timeout_s, message)
        time.sleep(_pause(deadline, interval_s))


async def wait_until_async(
    condition: Callable[[], T | None],
    *,
    timeout_s: float,
    message: str | Callable[[], str],
    interval_s: float = 0.05,
) -> T:
    """wait_until for a coroutine: the same polls, sleeping with asyncio.sleep so the event
    loop (and the task the condition watches) runs in between."""
    deadline = time.monotonic() + timeout_s
    while True:
        last_chance = time.monotonic() >= deadline
        if result := condition():
            return result
        if last_chance:
            raise _timed_out(timeout_s, message)
        await asyncio.sleep(_pause(deadline, interval_s))


def _pause(deadline: float, interval_s: float) -> float:
    return max(0.0, min(interval_s, deadline - time.monotonic()))


def _timed_out(timeout_s: float, message: str | Callable[[], str]) -> AssertionError:
    text = message() if callable(message) else message
    return AssertionError(f"not reached in {timeout_s:g} s: {text}")
