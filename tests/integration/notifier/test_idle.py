"""An idle notifier does its scans once a period and nothing in between (it woke its loop about 800 times a second:
the webhook sender read "no pending delivery" as "one due now" and scanned again after 5 ms, for ever), and an idle
stream costs its keep-alive and nothing more."""

from __future__ import annotations

import asyncio
import gc
import types
from collections import Counter
from collections.abc import Coroutine, Generator
from pathlib import Path
from typing import Any

import pytest

import services
import taskgate
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


OURS = (f"{Path(taskgate.__file__).parent}/", f"{Path(services.__file__).parent}/")  # the code under test's files


def _held() -> Counter[str]:
    """What the code under test holds now, by kind: closures (functions it made at run time), context managers, and
    its generators and coroutines (each a frame suspended in it)."""
    gc.collect()
    held: Counter[str] = Counter()
    for obj in gc.get_objects():
        kind = type(obj)  # never isinstance: it reads __class__, which some objects make a property that warns
        if kind.__module__ == "contextlib" and kind.__name__.endswith("ContextManager"):
            held["context managers"] += 1
        elif kind is types.FunctionType:
            code = obj.__code__
            held["closures"] += "<locals>" in code.co_qualname and code.co_filename.startswith(OURS)
        elif kind is types.AsyncGeneratorType:
            held["frames"] += obj.ag_code.co_filename.startswith(OURS)
        elif kind is types.CoroutineType:
            held["frames"] += obj.cr_code.co_filename.startswith(OURS)
    return held


async def test_an_idle_stream_holds_one_frame_per_layer_and_no_closures(
    backends: Backends, settings: Settings, api_key: str, notifier_factory: Any
) -> None:
    """An idle WatchTask stream holds the frames its layers wait in (the interceptor's, the caller's guard, the stream,
    its subscriber's wait) and nothing built per call besides: 10,000 idle streams each held nine closures (the
    interceptor's wrappers, the stream's helpers), three context managers and three more frames (~6 KiB a stream)."""
    handle = await notifier_factory(settings.model_copy(update={"stream_keepalive_seconds": KEEPALIVE}))
    tasks = [await insert_task(backends.pool) for _ in range(STREAMS)]

    async def keepalive(call: Any) -> None:
        while not (await call.read()).HasField("keepalive"):
            pass

    async with events_stub(handle) as stub:
        md = bearer(api_key)
        before = _held()
        calls = [stub.WatchTask(events_pb2.WatchTaskRequest(task_id=str(t.id)), metadata=md) for t in tasks]
        await asyncio.wait_for(asyncio.gather(*(keepalive(call) for call in calls)), 10)  # all idle now
        held = _held() - before
        for call in calls:
            call.cancel()
    assert held["closures"] < STREAMS / 2, f"{held['closures'] / STREAMS:.1f} closures per idle stream"
    assert held["context managers"] < STREAMS / 2, f"{held['context managers'] / STREAMS:.1f} per idle stream"
    assert held["frames"] <= 5 * STREAMS, f"{held['frames'] / STREAMS:.1f} suspended frames per idle stream"
