"""The notifier's live event feed against real NATS and PostgreSQL: a lost consumer is recreated where the feed
started, never from the stream's first event; a quiet stream gets from the table what the feed never brought."""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
from nats.js.api import ConsumerInfo

from services.notifier.event_feed import EventHub
from taskgate import bus as busmod
from taskgate import store
from taskgate.config import Settings
from taskgate.runtime import Backends
from taskgate.states import Status
from taskgate_api.v1 import events_pb2, task_pb2
from tests.support.factories import insert_task, moved
from tests.support.harness import bearer, wait_for
from tests.support.notifier import events_stub, fast, run_to

TASK = 7
TENANT = "tenant-feed"


async def publish(backends: Backends, version: int) -> None:
    event = task_pb2.TaskEvent(task_id=str(TASK), user_id=TENANT, version=version, event_id=version)
    await backends.bus.js.publish(busmod.event_subject(TENANT, TASK), event.SerializeToString())


async def test_a_lost_feed_resumes_where_it_started(backends: Backends) -> None:
    js = backends.bus.js
    for version in (1, 2, 3):  # events from before this process started: history, not live news
        await publish(backends, version)
    start = (await js.stream_info(busmod.EVENTS_STREAM)).state.last_seq + 1
    hub = EventHub(backends.bus, heartbeat_seconds=0.2)
    await hub.start()
    sub = hub.watch_task(TASK, capacity=100)
    try:
        # The consumer is lost before the feed delivered anything (as when NATS restarts): two missed heartbeats
        # and nats-py recreates it.
        (lost,) = await js.consumers_info(busmod.EVENTS_STREAM)  # this test's stream: the feed's consumer alone
        await js.delete_consumer(busmod.EVENTS_STREAM, lost.name)

        again: list[ConsumerInfo] = []

        async def recreated() -> bool:
            again[:] = [c for c in await js.consumers_info(busmod.EVENTS_STREAM) if c.name != lost.name]
            return bool(again)

        await wait_for(recreated, within=10)
        # not 1: the old events are not even sent (a set: on a loaded machine a late heartbeat may recreate it twice)
        assert {c.config.opt_start_seq for c in again} == {start}
        await publish(backends, 4)
        first = await asyncio.wait_for(sub.next(), timeout=10)
        assert isinstance(first, task_pb2.TaskEvent) and first.version == 4
    finally:
        hub.drop(sub)
        await hub.stop()


async def test_quiet_streams_get_from_the_table_what_the_feed_never_brought(
    backends: Backends, settings: Settings, api_key: str, notifier_factory: Any
) -> None:
    handle = await notifier_factory(fast(settings, stream_keepalive_seconds=0.3))
    (relay,) = [loop for loop in handle.tasks if loop.get_name() == "notifier-relay"]
    relay.cancel()  # from now on the feed brings nothing: every event stays in the table only
    task = await insert_task(backends.pool)
    async with events_stub(handle) as stub:
        one = stub.WatchTask(events_pb2.WatchTaskRequest(task_id=str(task.id)), metadata=bearer(api_key))
        many = stub.WatchTasks(events_pb2.WatchTasksRequest(), metadata=bearer(api_key))
        assert (await one.read()).WhichOneof("kind") == "snapshot"
        assert (await many.read()).WhichOneof("kind") == "keepalive"  # caught up: live from here
        await run_to(backends.pool, task.id, Status.SUCCEEDED, progress_steps=[50])
        final = await backends.pool.fetchval("SELECT version FROM task WHERE id = $1", task.id)

        sent = []
        async with asyncio.timeout(10):
            while (msg := await one.read()) is not grpc.aio.EOF:  # the stream ends after the terminal event
                sent.append(msg)
        events = [msg.event for msg in sent if msg.WhichOneof("kind") == "event"]
        assert [e.version for e in events] == list(range(task.version + 1, final + 1))
        assert events[-1].to_status == task_pb2.TASK_STATUS_SUCCEEDED

        seen: list[int] = []
        async with asyncio.timeout(10):
            while seen[-1:] != [final]:
                msg = await many.read()
                assert msg is not grpc.aio.EOF
                if msg.WhichOneof("kind") == "event" and msg.event.task_id == str(task.id):
                    seen.append(msg.event.version)
        assert seen == list(range(task.version + 1, final + 1))
        many.cancel()


async def test_a_quiet_watch_tasks_stream_finds_an_event_below_its_cursor_that_committed_late(
    backends: Backends, settings: Settings, api_key: str, notifier_factory: Any
) -> None:
    """Ids commit out of order: an event whose id was taken before the stream's cursor but committed after the stream
    passed it, and that the live feed never brought, still arrives (the quiet check read only ids above the cursor)."""
    handle = await notifier_factory(fast(settings, stream_keepalive_seconds=0.2))
    (relay,) = [loop for loop in handle.tasks if loop.get_name() == "notifier-relay"]
    relay.cancel()  # the feed brings nothing: what arrives comes from the quiet checks' table reads
    late, early = await insert_task(backends.pool), await insert_task(backends.pool)
    async with events_stub(handle) as stub:
        many = stub.WatchTasks(events_pb2.WatchTasksRequest(), metadata=bearer(api_key))
        assert (await many.read()).WhichOneof("kind") == "keepalive"

        async def next_event_of(task_id: int) -> Any:
            async with asyncio.timeout(10):
                while True:
                    msg = await many.read()
                    assert msg is not grpc.aio.EOF
                    if msg.WhichOneof("kind") == "event" and msg.event.task_id == str(task_id):
                        return msg

        async with backends.pool.acquire() as conn:
            slow = conn.transaction()
            await slow.start()
            try:
                assert (await moved(conn, late.id, store.Queue())).applied  # its event id is taken, not committed
                assert (await moved(backends.pool, early.id, store.Queue())).applied  # a higher id, committed first
                passed = await next_event_of(early.id)
                late_id = await backends.pool.fetchval("SELECT max(id) FROM task_event WHERE task_id = $1", early.id)
                assert int(passed.cursor) == late_id
            finally:
                await slow.commit()
        found = await next_event_of(late.id)  # below the cursor, committed after the stream passed it
        assert found.event.to_status == task_pb2.TASK_STATUS_QUEUED and found.event.event_id < int(passed.cursor)
        many.cancel()
