"""Keepalive: one tick finds every stream quiet for a period, reads for all of them in one statement the newest thing
the table has for each one's key, and wakes each with its own; a read that fails or hangs still lets the keep-alives
out. An idle stream costs no read, no task and no timer of its own."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine, Generator
from typing import Any

import asyncpg

from services.notifier.subscriber import Keepalive, Subscriber

PERIOD = 0.2  # the keep-alive period here: a tick every 0.1 s


class Reads:
    def __init__(self, fail: bool = False) -> None:
        self.calls: list[list[int | str]] = []
        self.fail = fail
        self.release = asyncio.Event()
        self.release.set()
        self.reading = asyncio.Event()

    async def __call__(self, keys: list[int | str]) -> dict[int | str, int]:
        self.calls.append(sorted(keys, key=str))
        self.reading.set()
        await self.release.wait()
        if self.fail:
            raise asyncpg.PostgresConnectionError("down")
        return {key: key * 10 for key in keys if isinstance(key, int) and key % 2 == 0} | {"tenant-a": 7}


def quiet(keys: list[int | str], keepalive: Keepalive) -> list[Subscriber]:
    subs = [Subscriber(key, 10) for key in keys]
    for sub in subs:
        keepalive.add(sub)
        sub.quiet_since -= PERIOD  # quiet for a whole period already: the next tick wakes it
    return subs


async def test_the_streams_one_tick_wakes_are_one_read_each_with_its_own_answer() -> None:
    reads = Reads()
    keepalive = Keepalive(PERIOD, newest=reads)
    keys: list[int | str] = [*range(100), "tenant-a"]
    subs = quiet(keys, keepalive)
    got = await asyncio.wait_for(asyncio.gather(*(sub.next() for sub in subs)), 5)
    assert got == [None] * len(subs)  # a keep-alive is due on each
    assert reads.calls == [sorted(keys, key=str)]
    assert [sub.newest for sub in subs] == [k * 10 if k % 2 == 0 else None for k in range(100)] + [7]
    for sub in subs:
        keepalive.discard(sub)


async def test_a_failed_read_still_lets_the_keepalives_out_and_the_next_period_reads_again() -> None:
    reads = Reads(fail=True)
    keepalive = Keepalive(PERIOD, newest=reads)
    subs = quiet([2, 4], keepalive)
    assert await asyncio.wait_for(asyncio.gather(*(sub.next() for sub in subs)), 5) == [None, None]
    assert [sub.newest for sub in subs] == [None, None]
    reads.fail = False
    assert await asyncio.wait_for(subs[0].next(), 5) is None  # its next quiet period
    assert subs[0].newest == 20 and len(reads.calls) >= 2
    for sub in subs:
        keepalive.discard(sub)


async def test_a_read_that_hangs_still_lets_the_keepalives_out() -> None:
    reads = Reads()
    reads.release.clear()  # never answers
    keepalive = Keepalive(PERIOD, newest=reads)
    [sub] = quiet([2], keepalive)
    assert await asyncio.wait_for(sub.next(), 5) is None and sub.newest is None
    keepalive.discard(sub)


async def test_a_stream_that_got_an_event_during_the_read_gets_no_keepalive() -> None:
    reads = Reads()
    reads.release.clear()
    keepalive = Keepalive(PERIOD, newest=reads)
    busy, idle = quiet([2, 4], keepalive)
    await reads.reading.wait()  # the tick's read has begun
    event = object()
    busy.offer(event)  # type: ignore[arg-type]
    assert await busy.next() is event
    reads.release.set()
    assert await asyncio.wait_for(idle.next(), 5) is None and idle.newest == 40
    assert not busy._keepalive  # the event reset its quiet period: no keep-alive owed yet
    for sub in (busy, idle):
        keepalive.discard(sub)


async def test_waking_many_idle_streams_costs_one_task_a_tick() -> None:
    reads = Reads()
    keepalive = Keepalive(PERIOD, newest=reads)
    subs = quiet(list(range(1_000)), keepalive)
    readers = [asyncio.ensure_future(sub.next()) for sub in subs]  # each stream waits for its next item
    await asyncio.sleep(0)
    created = 0
    loop = asyncio.get_running_loop()

    def factory(
        loop: asyncio.AbstractEventLoop, coro: Generator[Any, None, Any] | Coroutine[Any, Any, Any], **kw: Any
    ) -> asyncio.Task[Any]:
        nonlocal created
        created += 1
        return asyncio.Task(coro, loop=loop, **kw)

    loop.set_task_factory(factory)
    try:
        assert await asyncio.wait_for(asyncio.gather(*readers), 5) == [None] * len(subs)
    finally:
        loop.set_task_factory(None)
    assert created <= 1, f"{created} tasks to wake {len(subs)} streams"
    for sub in subs:
        keepalive.discard(sub)
