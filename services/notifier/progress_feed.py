"""Running tasks' progress, live, for the WatchTask streams of this process (taskgate.wire.progress).

Workers publish one message per tenant per tick (the newest step of each of its tasks that moved). This process
follows a tenant's progress subject with ONE core subscription while a stream here sees one of that tenant's tasks
PROCESSING, shared by every such stream and dropped with the last of them, and hands each item to the streams of its
task: a notifier holding streams of queued tasks subscribes to nothing. Nothing is read back: a step missed (before
the subscription reached the server, in a reconnect) is superseded by the next one.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from nats.aio.msg import Msg

from taskgate import bus as busmod
from taskgate.wire import progress as progress_wire
from taskgate_api.v1 import task_pb2

from .subscriptions import Background, unsubscribe

log = logging.getLogger("taskgate.notifier.progress")


class Receiver(Protocol):
    """What a stream offers its live progress to (subscriber.Subscriber)."""

    def offer_progress(self, item: task_pb2.TaskProgress) -> None: ...


@dataclass(eq=False)
class _Follow:
    """One followed task: its tenant and the streams of this process that follow it."""

    user_id: str
    receivers: set[Receiver] = field(default_factory=set)


@dataclass(eq=False)
class _Tenant:
    """One tenant whose progress this process follows: its followed tasks, and its subscription once made."""

    tasks: set[int] = field(default_factory=set)
    subscription: Any = None
    ended: bool = False


class ProgressHub:
    """The core subscriptions of the tenants whose running tasks this process's streams follow, one per tenant."""

    def __init__(self, bus: busmod.Bus) -> None:
        self._bus = bus
        self._follows: dict[int, _Follow] = {}
        self._tenants: dict[str, _Tenant] = {}
        self._pending = Background()  # SUBs and UNSUBs on their way

    def follow(self, user_id: str, task_id: int, receiver: Receiver) -> None:
        """Offers `receiver` the task's progress from (about) now on; a subscription is made in the background."""
        follow = self._follows.get(task_id)
        if follow is None:
            follow = self._follows[task_id] = _Follow(user_id)
            tenant = self._tenants.get(user_id)
            if tenant is None:
                tenant = self._tenants[user_id] = _Tenant()
                self._pending.spawn(self._subscribe(user_id, tenant), "notifier-progress-follow")
            tenant.tasks.add(task_id)
        follow.receivers.add(receiver)

    def unfollow(self, task_id: int, receiver: Receiver) -> None:
        """Stops offering progress to `receiver`; the tenant's subscription ends with its last followed task."""
        follow = self._follows.get(task_id)
        if follow is None:
            return
        follow.receivers.discard(receiver)
        if follow.receivers:
            return
        del self._follows[task_id]
        tenant = self._tenants.get(follow.user_id)
        if tenant is None:
            return
        tenant.tasks.discard(task_id)
        if tenant.tasks:
            return
        del self._tenants[follow.user_id]
        tenant.ended = True
        if tenant.subscription is not None:
            self._pending.spawn(unsubscribe(tenant.subscription), "notifier-progress-unfollow")

    async def stop(self) -> None:
        """Waits for the SUBs and UNSUBs on their way (their connection's close drops the subscriptions)."""
        await self._pending.stop()

    async def _subscribe(self, user_id: str, tenant: _Tenant) -> None:
        try:
            subscription = await self._bus.nc.subscribe(busmod.progress_subject(user_id), cb=self._deliver(user_id))
        except Exception:  # a stream's progress is a nicety: it still gets every event
            log.warning("progress subscription failed", extra={"user_id": user_id}, exc_info=True)
            if self._tenants.get(user_id) is tenant:  # the next stream that follows one of its tasks tries again
                del self._tenants[user_id]
                for task_id in tenant.tasks:
                    self._follows.pop(task_id, None)
            return
        if tenant.ended:  # its last stream left meanwhile
            await unsubscribe(subscription)
        else:
            tenant.subscription = subscription

    def _deliver(self, user_id: str) -> Callable[[Msg], Awaitable[None]]:
        async def deliver(msg: Msg) -> None:
            items = progress_wire.decode(msg.data)
            if items is None:
                log.error("undecodable progress dropped", extra={"subject": msg.subject})
                return
            for item in items:
                follow = self._follows.get(int(item.task_id))
                if follow is None or follow.user_id != user_id:  # not followed here, or not this tenant's task
                    continue
                for receiver in list(follow.receivers):
                    receiver.offer_progress(item)

        return deliver

    @property
    def followed(self) -> int:
        """How many tasks this process follows (tests and gauges)."""
        return len(self._follows)

    @property
    def subscriptions(self) -> int:
        """How many tenants' progress this process follows (tests)."""
        return len(self._tenants)
