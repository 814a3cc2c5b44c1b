"""Newest: what every quiet stream of one keep-alive tick asks is read in one statement, and an answer always comes."""

from __future__ import annotations

import asyncio

import asyncpg
import pytest

from services.notifier.shared_reads import Newest


class Reads:
    def __init__(self, fail: bool = False) -> None:
        self.calls: list[list[int]] = []
        self.fail = fail
        self.release = asyncio.Event()
        self.release.set()
        self.reading = asyncio.Event()

    async def __call__(self, keys: list[int]) -> dict[int, int]:
        self.calls.append(keys)
        self.reading.set()
        await self.release.wait()
        if self.fail:
            raise asyncpg.PostgresConnectionError("down")
        return {key: key * 10 for key in keys if key % 2 == 0}


async def test_asks_made_together_are_one_read() -> None:
    reads = Reads()
    newest: Newest[int] = Newest(reads)
    got = await asyncio.gather(*(newest.of(key) for key in range(100)))
    assert reads.calls == [list(range(100))]
    assert got == [key * 10 if key % 2 == 0 else None for key in range(100)]


async def test_asks_made_during_a_read_go_together_in_the_next() -> None:
    reads = Reads()
    reads.release.clear()
    newest: Newest[int] = Newest(reads)
    first = asyncio.gather(*(newest.of(key) for key in (2, 4)))
    await reads.reading.wait()
    later = asyncio.gather(*(newest.of(key) for key in (4, 6, 8)))
    await asyncio.sleep(0)  # one turn of the loop: the later asks are made (not a wait for time)
    reads.release.set()
    assert await first == [20, 40]
    assert await later == [40, 60, 80]
    assert reads.calls == [[2, 4], [4, 6, 8]]


async def test_a_failed_read_answers_none_and_the_next_ask_reads_again() -> None:
    reads = Reads(fail=True)
    newest: Newest[int] = Newest(reads)
    assert list(await asyncio.gather(newest.of(2), newest.of(4))) == [None, None]
    reads.fail = False
    assert await newest.of(2) == 20
    assert reads.calls == [[2, 4], [2]]


async def test_a_stream_ending_while_it_waits_does_not_cancel_the_others() -> None:
    reads = Reads()
    reads.release.clear()
    newest: Newest[int] = Newest(reads)
    leaving = asyncio.ensure_future(newest.of(2))
    staying = asyncio.ensure_future(newest.of(2))
    await reads.reading.wait()
    leaving.cancel()
    with pytest.raises(asyncio.CancelledError):
        await leaving
    reads.release.set()
    assert await staying == 20
