"""Session.guard: a stream ends with UNAUTHENTICATED when its key is revoked or its client token expires, and costs
nothing per item nor per idle stream (it raced every item against the revocation: a task per item, one per stream)."""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import AsyncIterator, Awaitable, Coroutine, Generator
from datetime import UTC, datetime, timedelta
from typing import Any

import grpc
import pytest

from taskgate import clienttokens, errors
from taskgate.auth import Session
from taskgate.store.tenants import Principal

ITEMS = 1_000


def session(grant: clienttokens.Grant | None = None) -> Session:
    return Session(Principal("tenant-a", None, None), "digest", grant)


def grant(seconds: float) -> clienttokens.Grant:
    return clienttokens.Grant(
        "tenant-a", "user-1", frozenset({clienttokens.WATCH}), None, datetime.now(UTC) + timedelta(seconds=seconds), "k"
    )


class Counted:
    """Counts the tasks the running loop creates."""

    def __init__(self) -> None:
        self.created = 0
        self._loop = asyncio.get_running_loop()
        self._before = self._loop.get_task_factory()

    def __enter__(self) -> Counted:
        def factory(
            loop: asyncio.AbstractEventLoop, coro: Generator[Any, None, Any] | Coroutine[Any, Any, Any], **kw: Any
        ) -> asyncio.Task[Any]:
            self.created += 1
            return asyncio.Task(coro, loop=loop, **kw)

        self._loop.set_task_factory(factory)
        return self

    def __exit__(self, *exc: object) -> None:
        self._loop.set_task_factory(self._before)


async def numbers(count: int) -> AsyncIterator[int]:
    for i in range(count):
        await asyncio.sleep(0)  # each item waits, as a stream's next event does
        yield i


class Idle:
    """A stream that sends one item then waits for ever (an idle WatchTask); records that its cleanup ran."""

    def __init__(self) -> None:
        self.waiting = asyncio.Event()
        self.cleaned = False

    async def stream(self) -> AsyncIterator[int]:
        try:
            yield 0
            self.waiting.set()
            await asyncio.Event().wait()
            yield 1
        finally:
            self.cleaned = True


async def failure(consumed: Awaitable[object]) -> errors.ApiError:
    with pytest.raises(errors.ApiError) as caught:
        await asyncio.wait_for(consumed, 5)
    return caught.value


async def test_items_pass_through_the_guard_without_a_task_each() -> None:
    s = session()
    with Counted() as counted:
        got = [item async for item in s.guard(numbers(ITEMS))]
    assert got == list(range(ITEMS))
    assert counted.created <= 1, f"{counted.created} tasks created for {ITEMS} items"


class Item:
    """A streamed message (weakly referenced: whether anything still holds it)."""


async def test_an_idle_guarded_stream_holds_no_item_it_sent() -> None:
    """The guard lets go of an item once it is sent: an idle stream held its last message (a snapshot's ~1.6 KiB of
    upb, each of 10,000 idle streams)."""
    s, waiting = session(), asyncio.Event()

    async def stream() -> AsyncIterator[Item]:
        yield Item()
        waiting.set()
        await asyncio.Event().wait()
        yield Item()

    guarded = s.guard(stream())
    gone = weakref.ref(await anext(guarded))  # sent, and nothing of this test holds it
    reading: asyncio.Future[Item] = asyncio.ensure_future(anext(guarded))  # the stream waits for its next item
    await waiting.wait()
    assert gone() is None, "the guard still holds the item it sent"
    reading.cancel()
    with pytest.raises(asyncio.CancelledError):
        await reading


async def test_a_revoked_key_ends_an_idle_stream_with_unauthenticated() -> None:
    s, idle = session(), Idle()
    received: list[int] = []

    async def consume() -> None:
        async for item in s.guard(idle.stream()):
            received.append(item)

    reader = asyncio.create_task(consume())
    await idle.waiting.wait()
    s.revoke()
    error = await failure(reader)
    assert error.code is grpc.StatusCode.UNAUTHENTICATED and "revoked" in error.message
    assert received == [0] and idle.cleaned
    assert not reader.cancelling()  # the task is not left half-cancelled: its call's status goes out


async def test_a_revocation_while_an_item_is_sent_ends_the_stream_before_the_next() -> None:
    s = session()
    received: list[int] = []

    async def consume() -> None:
        async for item in s.guard(numbers(ITEMS)):
            received.append(item)
            if item == 3:
                s.revoke()  # the item is being sent: the stream was not waiting for its next one
                await asyncio.sleep(0)

    error = await failure(consume())
    assert error.code is grpc.StatusCode.UNAUTHENTICATED and received == [0, 1, 2, 3]


async def test_a_client_tokens_stream_ends_when_the_token_expires() -> None:
    s, idle = session(grant(0.05)), Idle()

    async def consume() -> None:
        async for _ in s.guard(idle.stream()):
            pass

    error = await failure(consume())
    assert error.code is grpc.StatusCode.UNAUTHENTICATED and "expired" in error.message and idle.cleaned


async def test_a_call_cancelled_as_its_key_is_revoked_stays_cancelled() -> None:
    s, idle = session(), Idle()

    async def consume() -> None:
        async for _ in s.guard(idle.stream()):
            pass

    reader = asyncio.create_task(consume())
    await idle.waiting.wait()
    s.revoke()
    reader.cancel()  # the call ended too (the client went away): its cancel is not swallowed
    with pytest.raises(asyncio.CancelledError):
        await reader
    assert idle.cleaned


async def test_a_key_revoked_before_the_stream_starts_ends_it_at_once() -> None:
    s, idle = session(), Idle()
    s.revoke()

    async def consume() -> None:
        async for _ in s.guard(idle.stream()):
            pass

    error = await failure(consume())
    assert error.code is grpc.StatusCode.UNAUTHENTICATED and "revoked" in error.message
