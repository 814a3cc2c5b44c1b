"""The device threads' steps to the event loop, coalesced: a thread's wake-up of the loop costs more than the step's
handling, so a worker's slots share at most one per `live_progress_tick_seconds` (services/worker/live.py)."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

R = TypeVar("R", bound=Hashable)


class StepInbox(Generic[R]):
    """Takes the steps the device threads report to the event loop: the first at once, then at most one hand-over
    per `tick` seconds carrying the newest step of each run that stepped meanwhile (a thread's wake-up of the loop
    costs more than the step's handling)."""

    def __init__(self, tick: float, handle: Callable[[R, int, int], None]) -> None:
        self._tick = tick
        self._handle = handle  # called on the event loop with (run, step, total)
        self._lock = threading.Lock()
        self._pending: dict[R, tuple[int, int]] = {}
        self._armed = False  # a hand-over is on its way: a step only joins it
        self._last = -float("inf")  # monotonic: when the last hand-over ran
        self.handovers = 0  # how many ran (tests)

    def report(self, loop: asyncio.AbstractEventLoop, run: R, step: int, total: int) -> None:
        """A run's step (from any thread)."""
        with self._lock:
            self._pending[run] = (step, total)
            if self._armed:
                return
            self._armed = True
            delay = self._last + self._tick - time.monotonic()
        loop.call_soon_threadsafe(self._arm, loop, delay)

    def flush(self, run: R) -> None:
        """Hands over `run`'s pending step now (on the event loop): its device phase ended, the steps it reported come
        before whatever the run does next."""
        with self._lock:
            pending = self._pending.pop(run, None)
        if pending is not None:
            self._handle(run, *pending)

    def _arm(self, loop: asyncio.AbstractEventLoop, delay: float) -> None:
        if delay > 0:
            loop.call_later(delay, self._hand_over)
        else:
            self._hand_over()

    def _hand_over(self) -> None:
        with self._lock:
            pending, self._pending = self._pending, {}
            self._armed = False
            self._last = time.monotonic()
        self.handovers += 1
        for run, (step, total) in pending.items():
            self._handle(run, step, total)
