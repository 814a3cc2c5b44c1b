"""One shape for every background loop (shared by every service): a pass, then a wait; a failed pass logged and the
next one tried; a cancellation always ends it, even one a client library turned into an error of its own."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Mapping

from taskgate.waiting import cancelling, woken

Pass = Callable[[], Awaitable[float | None]]


async def repeat(
    step: Pass,
    *,
    every: float,
    log: logging.Logger,
    failed: str,
    wake: asyncio.Event | None = None,
    stop: asyncio.Event | None = None,
    wait_first: bool = False,
    survives: tuple[type[Exception], ...] = (Exception,),
    extra: Callable[[], Mapping[str, object]] | None = None,
    level: int = logging.WARNING,
    traceback: bool = False,
    on_pass: Callable[[], object] | None = None,
) -> None:
    """Runs `step` until cancelled or `stop` is set, waiting after each pass the seconds it returned (None: `every`;
    0 or less: the next pass at once), or `every` after a failed pass; `wait_first` waits `every` before the first.

    `wake` cuts a wait short and is cleared before each pass (a wake during a pass runs the next at once); or `stop`
    cuts a wait short and ends the loop before the next pass. A pass raising one of `survives` is logged at `level` as
    `failed` with `extra()` and the error (its traceback too with `traceback`), and the loop goes on; anything else ends
    the loop with that error (a service's liveness probe sees the loop done). `on_pass` is called after every pass,
    failed or not (a test's signal).
    """
    if wake is not None and stop is not None:
        raise TypeError("repeat() takes a wake event or a stop event, not both")
    if wait_first:
        await _pause(every, wake or stop)
    while stop is None or not stop.is_set():
        if wake is not None:
            wake.clear()
        try:
            wait = await step()
        except survives as exc:
            if cancelling():  # a client library reported our cancellation as its own error
                raise asyncio.CancelledError from exc
            error = f"{type(exc).__name__}: {exc}"[:300]
            log.log(
                level, failed, extra={**(extra() if extra else {}), "error": error}, exc_info=exc if traceback else None
            )
            wait = every
        if on_pass is not None:
            on_pass()
        await _pause(every if wait is None else wait, wake or stop)


async def _pause(seconds: float, event: asyncio.Event | None) -> None:
    """Waits `seconds`, or until `event` is set; a cancellation pending on the task is honoured first."""
    if seconds > 0 and event is not None:
        await woken(event, seconds)
        return
    if cancelling():
        raise asyncio.CancelledError
    await asyncio.sleep(max(seconds, 0))
