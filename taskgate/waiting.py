"""Waiting in background loops without ever losing a cancellation, and awaiting work that a stop cuts short (shared
by every service)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable
from typing import Any, TypeVar

T = TypeVar("T")


class Interrupted(Exception):
    """The stop came before the work finished; the work was cancelled."""


async def unless(stop: asyncio.Future[Any], work: Awaitable[T]) -> T:
    """`work`'s result (or its error), or Interrupted once `stop` is done first: `work` is then cancelled and awaited,
    so nothing of it runs on. `stop` is the caller's (say `ensure_future(event.wait())`), reused across calls."""
    doing = asyncio.ensure_future(work)
    try:
        await asyncio.wait((doing, stop), return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not doing.done():
            doing.cancel()
            with contextlib.suppress(asyncio.CancelledError, StopAsyncIteration):
                await doing
    if doing.cancelled():
        raise Interrupted
    return doing.result()


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
