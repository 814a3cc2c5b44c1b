"""Terminal events straight to watchers: the worker that commits a task's end hints it (taskgate.wire.ended), and the
notifier hands that version, read from the table, to the task's WatchTask streams without waiting for the relay; the
relay stays the way every event reaches every stream, each stream dropping the copy that comes second."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from services.notifier.relay import TestSignals
from taskgate import bus as busmod
from taskgate.config import Settings
from taskgate.runtime import Backends
from taskgate_api.v1 import events_pb2, task_pb2
from tests.support.factories import sleepy_settings, submit
from tests.support.notifier import events_stub, fast

TERMINAL = {task_pb2.TASK_STATUS_SUCCEEDED, task_pb2.TASK_STATUS_FAILED, task_pb2.TASK_STATUS_CANCELED}


async def _follow(stub: Any, task_id: int, api_key: str) -> list[tuple[int, int]]:
    """(version, status) of the snapshot and each event of one WatchTask stream, until its terminal one."""
    seen: list[tuple[int, int]] = []
    call = stub.WatchTask(events_pb2.WatchTaskRequest(task_id=str(task_id)),
                          metadata=(("authorization", f"Bearer {api_key}"),))
    async for item in call:
        if item.HasField("snapshot"):
            seen.append((item.snapshot.version, item.snapshot.status))
        elif item.HasField("event"):
            seen.append((item.event.version, item.event.to_status))
        if seen and seen[-1][1] in TERMINAL:
            return seen
    return seen


async def test_the_end_reaches_a_watchtask_stream_while_the_relay_is_stuck(
    backends: Backends, settings: Settings, notifier_factory: Any, workers: Any, api_key: str
) -> None:
    stuck = asyncio.Event()

    async def never_commits(_ids: Sequence[int]) -> None:
        stuck.set()
        await asyncio.Event().wait()  # the relay's pass hangs: nothing reaches the JetStream feed

    # a keep-alive period far beyond the test: the streams' quiet check of the table cannot be what delivers
    tuned = fast(settings, stream_keepalive_seconds=120.0)
    notifier = await notifier_factory(tuned, signals=TestSignals(before_commit=never_commits))
    task = await submit(backends)
    async with events_stub(notifier) as stub:
        following = asyncio.create_task(_follow(stub, task.id, api_key))
        await asyncio.wait_for(stuck.wait(), 10)
        # a hint names a version; one that was never committed brings nothing (the event is the table's row)
        await backends.bus.nc.publish(busmod.ended_subject(task.id, 9))
        await workers(sleepy_settings(tuned, sleep=0.3))
        seen = await asyncio.wait_for(following, 20)
    rows = await backends.pool.fetch("SELECT version, to_status::text AS s FROM task_event WHERE task_id = $1 ORDER BY version",
                                     task.id)
    assert rows[-1]["s"] == "SUCCEEDED"
    versions = [v for v, _ in seen]
    # the snapshot, then every later version once and in order (the ones before the end read from the table at the gap)
    assert versions == list(range(versions[0], rows[-1]["version"] + 1)), seen
    assert seen[-1][1] == task_pb2.TASK_STATUS_SUCCEEDED
    assert await backends.pool.fetchval("SELECT count(*) FROM event_outbox") > 0  # the relay really published nothing


async def test_with_the_relay_running_each_version_arrives_once(
    backends: Backends, settings: Settings, notifier_factory: Any, workers: Any, api_key: str
) -> None:
    notifier = await notifier_factory(fast(settings))
    await workers(sleepy_settings(settings, sleep=0.3))
    for _ in range(3):
        task = await submit(backends)
        async with events_stub(notifier) as stub:
            seen = await asyncio.wait_for(_follow(stub, task.id, api_key), 20)
        versions = [v for v, _ in seen]
        assert versions == sorted(set(versions)) and versions == list(range(versions[0], versions[-1] + 1)), seen
        assert seen[-1][1] == task_pb2.TASK_STATUS_SUCCEEDED
