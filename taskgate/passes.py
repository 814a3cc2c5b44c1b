"""Natural batching without a timer: items handed in while a pass runs wait for the next pass, which takes all of them
(up to `max_batch`). A lone item goes at once; under load each pass carries what arrived during the one before.

The dispatcher's passes (taskgate/dispatcher.py) and the gateway's admissions (services/submit/batching.py) run this
way.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Awaitable, Callable, Iterable
from typing import Generic, TypeVar

T = TypeVar("T")


class Passes(Generic[T]):
    """One pass in flight over the items handed in; the next pass takes the next `max_batch` of those that queued.

    `run_pass` is awaited with each batch, in order; what it raises ends the passes (it handles its own errors).
    `stopped`, when given, gets the items still queued when the passes end (cancelled, or `run_pass` raised), and they
    are dropped; without it they stay for the next pass, which the next `add` starts.
    """

    def __init__(
        self, run_pass: Callable[[list[T]], Awaitable[None]], *, max_batch: int, name: str | None = None,
        stopped: Callable[[list[T]], None] | None = None,
    ) -> None:
        self._run_pass = run_pass
        self._max_batch = max_batch
        self._name = name
        self._stopped = stopped
        self.pending: deque[T] = deque()
        self.runner: asyncio.Task[None] | None = None
        """The task running the passes; None when nothing is queued."""

    def add(self, items: Iterable[T]) -> None:
        """Queues `items` for a pass; starts the passes when none runs. Returns at once."""
        self.pending.extend(items)
        if self.pending and self.runner is None:
            self.runner = asyncio.create_task(self._passes(), name=self._name)

    async def _passes(self) -> None:
        try:
            while self.pending:
                await self._run_pass([self.pending.popleft() for _ in range(min(self._max_batch, len(self.pending)))])
        finally:
            self.runner = None
            if self._stopped is not None and self.pending:
                left = list(self.pending)
                self.pending.clear()
                self._stopped(left)
