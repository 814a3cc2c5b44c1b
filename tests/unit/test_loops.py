"""taskgate.loops.repeat, the shape of every background loop: passes and waits, wake and stop, a failed pass logged
and survived, anything else ending the loop, and a cancellation always ending it (no servers)."""

from __future__ import annotations

import asyncio
import logging
import time

import pytest

from taskgate import loops

log = logging.getLogger("tests.loops")


class Passes:
    """Counts the passes of a loop (its on_pass) and lets a test await the n-th."""

    def __init__(self) -> None:
        self.count = 0
        self._changed = asyncio.Event()

    def __call__(self) -> None:
        self.count += 1
        self._changed.set()
        self._changed = asyncio.Event()

    async def reach(self, n: int) -> None:
        async with asyncio.timeout(5):
            while self.count < n:
                await self._changed.wait()


async def test_a_pass_waits_what_it_returned_and_a_wake_cuts_the_wait_short() -> None:
    wake = asyncio.Event()
    passes = Passes()

    async def step() -> float:
        return 3600.0  # the next pass an hour later, unless woken

    task = asyncio.create_task(loops.repeat(step, every=1.0, wake=wake, log=log, failed="x", on_pass=passes))
    await passes.reach(1)
    wake.set()
    await passes.reach(2)  # within the timeout, not an hour
    assert not wake.is_set()  # cleared before the pass
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert passes.count == 2


async def test_a_failed_pass_is_logged_and_the_next_one_tried(caplog: pytest.LogCaptureFixture) -> None:
    passes = Passes()
    calls = 0

    async def step() -> None:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise OSError("the database went away")

    caplog.set_level(logging.WARNING, logger=log.name)
    task = asyncio.create_task(
        loops.repeat(
            step,
            every=0.01,
            log=log,
            failed="scan failed",
            survives=(OSError,),
            extra=lambda: {"worker": "w1"},
            on_pass=passes,
        )
    )
    await passes.reach(3)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    [record] = [r for r in caplog.records if r.name == log.name]
    assert record.getMessage() == "scan failed" and record.levelno == logging.WARNING
    assert record.__dict__["error"] == "OSError: the database went away" and record.__dict__["worker"] == "w1"
    assert record.exc_info is None


async def test_an_error_it_does_not_survive_ends_the_loop() -> None:
    async def step() -> None:
        raise KeyError("a bug")

    with pytest.raises(KeyError):
        await asyncio.wait_for(loops.repeat(step, every=0.01, log=log, failed="x", survives=(OSError,)), 5)


async def test_stop_ends_the_loop_and_cuts_its_wait_short() -> None:
    stop = asyncio.Event()
    passes = Passes()

    async def step() -> None:
        return None  # `every`: an hour

    task = asyncio.create_task(loops.repeat(step, every=3600.0, stop=stop, log=log, failed="x", on_pass=passes))
    await passes.reach(1)
    stop.set()
    await asyncio.wait_for(task, 5)
    assert passes.count == 1
    with pytest.raises(TypeError):
        await loops.repeat(step, every=1.0, wake=asyncio.Event(), stop=stop, log=log, failed="x")


async def test_a_cancellation_a_library_turned_into_its_own_error_still_ends_the_loop() -> None:
    entered = asyncio.Event()

    async def step() -> None:
        entered.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            raise OSError("stalled") from None  # as nats-py's publish_async does

    task = asyncio.create_task(loops.repeat(step, every=0.01, log=log, failed="x", survives=(OSError,)))
    await entered.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(task, 5)


async def test_wait_first_waits_before_the_first_pass() -> None:
    began = time.monotonic()
    first: list[float] = []

    async def step() -> None:
        first.append(time.monotonic())
        raise asyncio.CancelledError  # one pass is enough

    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(loops.repeat(step, every=0.2, wait_first=True, log=log, failed="x"), 5)
    assert first[0] - began >= 0.2
