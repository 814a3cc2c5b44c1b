"""The notifier's live event feed (EventHub) against real NATS: a lost consumer is recreated where the feed started,
never from the stream's first event."""

from __future__ import annotations

import asyncio

from nats.js.api import ConsumerInfo

from services.notifier.streams import EventHub
from taskgate import bus as busmod
from taskgate.runtime import Backends
from taskgate_api.v1 import task_pb2
from tests.support.harness import wait_for

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
        assert first is not None and first.version == 4
    finally:
        hub.drop(sub)
        await hub.stop()
