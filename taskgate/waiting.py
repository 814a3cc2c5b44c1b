"""Waiting in background loops without ever losing a cancellation (shared by every service)."""

from __future__ import annotations

import asyncio
import contextlib


async def woken(event: asyncio.Event, seconds: float) -> bool:
    """Waits until `event` is set or `seconds` pass; True when it was set (asyncio.timeout keeps cancels intact).

    A cancellation that something below turned into its own error and swallowed (nats-py's publish_async raises
    TooManyStalledMsgsError for one) is still pending on the task: it is honoured here, so a loop that waits
    through this function always stops when cancelled.
    """
    if cancelling():
        raise asyncio.CancelledError
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(seconds):
            await event.wait()
    return event.is_set()


def cancelling() -> bool:
    """Whether the current task is being cancelled (an error raised while unwinding must not hide that)."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0
