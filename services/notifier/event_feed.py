"""The event feed: EventHub, the process's one ordered JetStream consumer of every task event, fanned out to the
Subscribers of its WatchTask streams (by task) and WatchTasks streams (by tenant)."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Hashable
from typing import Any, TypeVar

from nats.aio.msg import Msg
from nats.js.api import ConsumerConfig, DeliverPolicy

from taskgate import bus as busmod
from taskgate.wire import events as event_wire
from taskgate_api.v1 import task_pb2

from .subscriber import Subscriber

log = logging.getLogger("taskgate.notifier.streams")
K = TypeVar("K", bound=Hashable)
# a key's streams: the one stream itself, a set once there are more (most tasks have one watcher: an empty set per
# stream was 216 bytes of each of 10,000 idle streams)
Members = Subscriber | set[Subscriber]


def _members(found: Members | None) -> tuple[Subscriber, ...]:
    if found is None:
        return ()
    return (found,) if isinstance(found, Subscriber) else tuple(found)


def _join(table: dict[K, Members], key: K, sub: Subscriber) -> None:
    found = table.get(key)
    if found is None:
        table[key] = sub
    elif isinstance(found, Subscriber):
        table[key] = {found, sub}
    else:
        found.add(sub)


def _leave(table: dict[K, Members], key: K, sub: Subscriber) -> None:
    found = table.get(key)
    if found is sub:
        del table[key]
    elif isinstance(found, set):
        found.discard(sub)
        if not found:
            del table[key]


class EventHub:
    """Fans one ordered JetStream consumer of every task event out to the streams of this process."""

    def __init__(self, bus: busmod.Bus, heartbeat_seconds: float = 5.0) -> None:
        self._bus = bus
        self._heartbeat = heartbeat_seconds
        self._by_task: dict[int, Members] = {}
        self._by_user: dict[str, Members] = {}
        # the newest version handed to each watched task's WatchTask streams: a version's second copy (the relay's
        # after its commit's NOTIFY, or the other way round) is no news, and would cut a stream's ETA read short
        self._offered: dict[int, int] = {}
        self._sub: Any = None
        self._start = 0  # the stream sequence the feed starts at: nothing before it is this process's live news
        self.closing = False

    async def start(self) -> None:
        """Subscribes from the stream's end; the ordered consumer recovers from gaps and a lost consumer by itself.

        It starts at the sequence after the stream's last rather than with DeliverPolicy.NEW: nats-py recreates a lost
        consumer (two missed heartbeats: a NATS restart, a deleted consumer) from the sequence after the last one it
        delivered, which before the first delivery is 0, i.e. the whole stream, seven days of every tenant's events,
        replayed into this process's streams (shown by test_a_lost_feed_resumes_where_it_started). So the library's
        resume point is set to the start, and anything from before it that arrives all the same is dropped.
        """
        last = (await self._bus.js.stream_info(busmod.EVENTS_STREAM)).state.last_seq
        self._start = last + 1
        self._sub = await self._bus.js.subscribe(
            busmod.EVENT_SUBJECTS,
            stream=busmod.EVENTS_STREAM,
            cb=self._on_message,
            ordered_consumer=True,
            idle_heartbeat=self._heartbeat,
            config=ConsumerConfig(deliver_policy=DeliverPolicy.BY_START_SEQUENCE, opt_start_seq=self._start),
        )
        # A private field of nats-py (2.16 has no public way to set it), pinned by tests/unit/test_nats_privates.py:
        # that test fails when the library stops keeping or reading it, so the reach is revisited at the upgrade.
        resume = getattr(getattr(self._sub, "_sub", None), "_jsi", None)  # nats-py's ordered-consumer state
        if resume is not None and getattr(resume, "_sseq", None) == 0:
            resume._sseq = last

    async def stop(self) -> None:
        if self._sub is not None:
            with contextlib.suppress(Exception):
                await self._sub.unsubscribe()
            self._sub = None

    async def _on_message(self, msg: Msg) -> None:
        if msg.metadata.sequence.stream < self._start:
            return  # a recreated consumer replaying from before this process started (see start)
        event = event_wire.decode(msg.data)
        if event is None:
            log.error("undecodable event on the event stream", extra={"subject": msg.subject})
            return
        # routed by its subject (which only the relay may publish to), never by what the payload claims
        try:
            expected = busmod.event_subject(event.user_id, int(event.task_id))
        except ValueError:  # a user id that is no subject token
            expected = None
        if msg.subject != expected:
            log.error("event whose payload does not match its subject dropped", extra={"subject": msg.subject})
            return
        for sub in [*self._for_task(event), *_members(self._by_user.get(event.user_id))]:
            if not sub.offer(event):
                self.drop(sub)

    def watching(self, task_id: int) -> bool:
        """Whether a WatchTask stream of this process follows the task."""
        return task_id in self._by_task

    def offer_task(self, event: task_pb2.TaskEvent) -> None:
        """An event from its commit's NOTIFY or read from the table, for the task's WatchTask streams only (a
        WatchTasks stream's cursor follows the feed's order); the feed's later copy is not handed to them again."""
        for sub in self._for_task(event):
            if not sub.offer(event):
                self.drop(sub)

    def _for_task(self, event: task_pb2.TaskEvent) -> tuple[Subscriber, ...]:
        """The task's WatchTask streams, unless they were handed this version (or a later one) already."""
        task_id = int(event.task_id)
        subs = _members(self._by_task.get(task_id))
        if not subs or event.version <= self._offered.get(task_id, 0):
            return ()
        self._offered[task_id] = event.version
        return subs

    def watch_task(self, task_id: int, capacity: int) -> Subscriber:
        """Buffers one task's live events from now on."""
        sub = Subscriber(task_id, capacity)
        _join(self._by_task, task_id, sub)
        if self.closing:
            sub.close()
        return sub

    def watch_user(self, user_id: str, capacity: int) -> Subscriber:
        """Buffers every live event of one tenant from now on."""
        sub = Subscriber(user_id, capacity)
        _join(self._by_user, user_id, sub)
        if self.closing:
            sub.close()
        return sub

    def close_streams(self) -> None:
        """Shutting down: every stream (and any that opens from now on) ends with UNAVAILABLE and where to resume."""
        self.closing = True
        for found in (*self._by_task.values(), *self._by_user.values()):
            for sub in _members(found):
                sub.close()

    def drop(self, sub: Subscriber) -> None:
        """Stops buffering for a subscriber."""
        if isinstance(sub.key, int):
            _leave(self._by_task, sub.key, sub)
            if sub.key not in self._by_task:
                self._offered.pop(sub.key, None)
        else:
            _leave(self._by_user, sub.key, sub)

    @property
    def subscribers(self) -> int:
        """How many streams are attached (tests and gauges)."""
        return sum(len(_members(found)) for found in (*self._by_task.values(), *self._by_user.values()))
