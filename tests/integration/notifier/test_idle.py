"""An idle notifier does its scans once a period and nothing in between (it woke its loop about 800 times a second:
the webhook sender read "no pending delivery" as "one due now" and scanned again after 5 ms, for ever), and an idle
stream costs its keep-alive and nothing more."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Coroutine, Generator
from typing import Any

import pytest

from taskgate.config import Settings
from taskgate.runtime import Backends
from taskgate.store import webhooks as webhook_store
from taskgate_api.v1 import events_pb2
from tests.support.factories import insert_task
from tests.support.harness import bearer
from tests.support.notifier import events_stub

SCAN = 0.5  # the webhook sender's safety-net period here
WINDOW = 2.0  # seconds counted


async def test_no_pending_delivery_is_none_due(backends: Backends) -> None:
    assert await backends.pool.fetchval("SELECT count(*) FROM callback_delivery") == 0
    assert await webhook_store.seconds_to_next_due(backends.pool) is None


async def test_an_idle_webhook_sender_scans_once_a_period(
    backends: Backends, settings: Settings, notifier_factory: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    claims: list[float] = []
    original = webhook_store.claim_due

    async def counted(*args: Any, **kwargs: Any) -> Any:
        claims.append(asyncio.get_running_loop().time())
        return await original(*args, **kwargs)

    monkeypatch.setattr(webhook_store, "claim_due", counted)
    await notifier_factory(settings.model_copy(update={"webhook_scan_interval_seconds": SCAN}))
    claims.clear()
    await asyncio.sleep(WINDOW)  # the window measured, nothing awaited: an idle sender must stay idle through it
    passes = len(claims) / 2  # a pass claims for each of its two lanes (results, progress)
    assert passes <= WINDOW / SCAN + 1, f"{passes:.0f} passes in {WINDOW} s with a {SCAN} s scan period"


STREAMS = 50  # idle WatchTask streams
KEEPALIVE = 0.3  # their keep-alive period here


async def test_idle_streams_make_no_task_per_keepalive(
    backends: Backends, settings: Settings, api_key: str, notifier_factory: Any
) -> None:
    """An idle stream wakes for its keep-alive and nothing else: no task of its own per keep-alive (the quiet check is
    the tick's one read, the revocation guard none at all). It made three: the guard's race for its next item, and
    the quiet check's race of its own read against the feed's news."""
    handle = await notifier_factory(settings.model_copy(update={"stream_keepalive_seconds": KEEPALIVE}))
    tasks = [await insert_task(backends.pool) for _ in range(STREAMS)]
    created: Counter[str] = Counter()

    def factory(
        loop: asyncio.AbstractEventLoop, coro: Generator[Any, None, Any] | Coroutine[Any, Any, Any], **kw: Any
    ) -> asyncio.Task[Any]:
        code = getattr(coro, "cr_code", None)
        name = code.co_qualname if code is not None else type(coro).__name__
        if not name.startswith(f"{test_idle_streams_make_no_task_per_keepalive.__name__}."):  # not this test's readers
            created[name] += 1
        return asyncio.Task(coro, loop=loop, **kw)

    async def keepalive(call: Any) -> None:
        while not (await call.read()).HasField("keepalive"):
            pass

    async with events_stub(handle) as stub:
        md = bearer(api_key)
        calls = [stub.WatchTask(events_pb2.WatchTaskRequest(task_id=str(t.id)), metadata=md) for t in tasks]
        for call in calls:
            assert (await call.read()).HasField("snapshot")
        await asyncio.wait_for(asyncio.gather(*(keepalive(call) for call in calls)), 10)  # all idle now
        loop = asyncio.get_running_loop()
        loop.set_task_factory(factory)
        try:
            for _ in range(2):  # two more keep-alives on every stream
                await asyncio.wait_for(asyncio.gather(*(keepalive(call) for call in calls)), 10)
        finally:
            loop.set_task_factory(None)
        for call in calls:
            call.cancel()
    assert sum(created.values()) < STREAMS, f"tasks created while {STREAMS} idle streams got 2 keep-alives: {created}"
