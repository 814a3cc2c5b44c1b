"""Test signals (river's testsignal pattern): the points in a service's run a test can await, no-ops in production.

A service takes one typed `TestSignals` dataclass of its own at construction (None: a disarmed one); a test passes one
whose signals it armed and awaits them. A disarmed signal keeps nothing, so production pays one attribute check.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")

KEPT = 1000  # an armed signal keeps its last values (a test reads them; a long-running test does not grow)


class Signal(Generic[T]):
    """Something a service did: kept (the last `KEPT`) once a test armed it, dropped otherwise."""

    def __init__(self) -> None:
        self._seen: list[T] | None = None
        self._changed: asyncio.Event | None = None

    def arm(self) -> Signal[T]:
        """Keeps what is signalled from now on (a test's call, before the service starts)."""
        if self._seen is None:
            self._seen = []
            self._changed = asyncio.Event()
        return self

    @property
    def seen(self) -> list[T]:
        """What was signalled since it was armed, oldest first."""
        return list(self._seen or ())

    def signal(self, value: T) -> None:
        """The service's call: a no-op unless armed."""
        if self._seen is None or self._changed is None:
            return
        self._seen.append(value)
        del self._seen[:-KEPT]
        self._changed.set()
        self._changed = asyncio.Event()

    async def wait_for(self, predicate: Callable[[T], bool], within: float = 10.0) -> T:
        """The first value (already seen or still to come) matching `predicate`, waiting up to `within` seconds."""
        if self._seen is None:
            raise RuntimeError("the signal is not armed: arm it before the service starts")
        deadline = time.monotonic() + within
        while True:
            for value in self._seen:
                if predicate(value):
                    return value
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("no matching signal")
            assert self._changed is not None
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), left)
