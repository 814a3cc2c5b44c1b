"""A running task's progress, live, for the WatchTask streams of this process (taskgate.wire.progress).

This process follows a task's progress subject with ONE core subscription while a stream of it here sees the task
PROCESSING, shared by every such stream and dropped with the last of them: a notifier holding streams of queued
tasks subscribes to nothing, and NATS sends it the progress of watched running tasks only. Nothing is read back: a
step missed (before the subscription reached the server, in a reconnect) is superseded by the next one.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from nats.aio.msg import Msg

from taskgate import bus as busmod
from taskgate.wire import progress as progress_wire
from taskgate_api.v1 import task_pb2

log = logging.getLogger("taskgate.notifier.progress")


class Receiver(Protocol):
    """What a stream offers its live progress to (streams.Subscriber)."""

    def offer_progress(self, item: task_pb2.TaskProgress) -> None: ...


@dataclass(eq=False)
class _Follow:
    """One followed task: the streams of this process that follow it, and its subscription once made."""

    receivers: set[Receiver] = field(default_factory=set)
    subscription: Any = None
    ended: bool = False


class ProgressHub:
    """The core subscriptions of the running tasks whose progress this process's streams follow, one per task."""

    def __init__(self, bus: busmod.Bus) -> None:
        self._bus = bus
        self._follows: dict[int, _Follow] = {}
        self._pending: set[asyncio.Task[None]] = set()  # SUBs and UNSUBs on their way (held: a task nobody holds may vanish)

    def follow(self, user_id: str, task_id: int, receiver: Receiver) -> None:
        """Offers `receiver` the task's progress from (about) now on; the subscription is made in the background."""
        follow = self._follows.get(task_id)
        if follow is None:
            follow = self._follows[task_id] = _Follow()
            self._spawn(self._subscribe(task_id, follow, busmod.progress_subject(user_id, task_id)), "notifier-progress-follow")
        follow.receivers.add(receiver)

    def unfollow(self, task_id: int, receiver: Receiver) -> None:
        """Stops offering progress to `receiver`; the task's subscription ends with its last receiver."""
        follow = self._follows.get(task_id)
        if follow is None:
            return
        follow.receivers.discard(receiver)
        if follow.receivers:
            return
        del self._follows[task_id]
        follow.ended = True
        if follow.subscription is not None:
            self._spawn(_unsubscribe(follow.subscription), "notifier-progress-unfollow")

    async def stop(self) -> None:
        """Waits for the SUBs and UNSUBs on their way (their connection's close drops the subscriptions)."""
        for task in list(self._pending):
            task.cancel()
        await asyncio.gather(*self._pending, return_exceptions=True)

    def _spawn(self, work: Awaitable[None], name: str) -> None:
        task = asyncio.ensure_future(work)
        task.set_name(name)
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)

    async def _subscribe(self, task_id: int, follow: _Follow, subject: str) -> None:
        try:
            subscription = await self._bus.nc.subscribe(subject, cb=self._deliver(task_id, follow))
        except Exception:  # a stream's progress is a nicety: it still gets every event
            log.warning("progress subscription failed", extra={"task_id": str(task_id)}, exc_info=True)
            if self._follows.get(task_id) is follow:
                del self._follows[task_id]  # the next stream that follows tries again
            return
        if follow.ended:  # its last stream left meanwhile
            await _unsubscribe(subscription)
        else:
            follow.subscription = subscription

    @staticmethod
    def _deliver(task_id: int, follow: _Follow) -> Callable[[Msg], Awaitable[None]]:
        async def deliver(msg: Msg) -> None:
            item = progress_wire.decode(msg, task_id)
            if item is None:
                log.error("undecodable progress dropped", extra={"subject": msg.subject})
                return
            for receiver in list(follow.receivers):
                receiver.offer_progress(item)

        return deliver

    @property
    def followed(self) -> int:
        """How many tasks this process follows (tests and gauges)."""
        return len(self._follows)


async def _unsubscribe(subscription: Any) -> None:
    with contextlib.suppress(Exception):  # a closed connection has dropped it already
        await subscription.unsubscribe()
