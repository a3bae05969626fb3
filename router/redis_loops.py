"""The router's loops over redis-py's asyncio client (the prefix-cache event reader, the replica
publisher and listener) must stop when their task is cancelled. redis-py waits for replies
with asyncio.wait_for, and on Python 3.11 wait_for returns the reply instead of raising when
a cancellation lands as the reply arrives: the loop would go on, and (under asyncio.gather) go
on after its owner has stopped. The cancellation is still pending on the task, so a loop asks
at each turn."""

from __future__ import annotations

import asyncio


def raise_if_cancelled() -> None:
    """Raises CancelledError if this task's cancellation was requested, even if some await
    swallowed it."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError
