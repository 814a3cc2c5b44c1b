"""What the live hubs (output_feed.OutputHub, progress_feed.ProgressHub) share about their core NATS subscriptions:
the SUBs and UNSUBs sent from tasks of their own (Background: held until done, a task nobody holds may vanish, so a
stream ended by a cancellation still leaves nothing behind), and an UNSUB that may find its connection closed
(`unsubscribe`)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable
from typing import Any


class Background:
    """A hub's SUBs and UNSUBs on their way, each a task held until it is done."""

    def __init__(self) -> None:
        self._tasks: set[asyncio.Task[None]] = set()

    def spawn(self, work: Awaitable[None], name: str) -> None:
        """Runs `work` in a task of its own, held until done."""
        task = asyncio.ensure_future(work)
        task.set_name(name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def stop(self) -> None:
        """Cancels the tasks on their way and waits for them."""
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


async def unsubscribe(subscription: Any) -> None:
    """Ends a core subscription (its UNSUB); nothing when its connection has dropped it already."""
    with contextlib.suppress(Exception):  # a closed connection has dropped it already
        await subscription.unsubscribe()
