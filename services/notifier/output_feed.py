"""A running task's output, live, for the WatchTask streams that asked for it (`include_output`).

The TASK_OUTPUT stream republishes each chunk once stored on `bus.output_live_subject`, with its sequence and the
sequence of the task's chunk before it. This process follows a watched task with ONE core subscription to that
subject, shared by every stream of the task here and dropped with the last of them: no JetStream consumer per stream
(none to create, delete or leak, no heartbeats), and a chunk reaches a stream as soon as it is stored. What a core
subscription can miss (the chunks before it began, one lost in a reconnect) a stream reads by sequence
(`taskgate.output.read_after`): the previous sequence each chunk carries shows the gap, and a stream reads its task's
remaining chunks from the stream's leader before it sends the terminal event.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from nats.aio.msg import Msg

from taskgate import bus as busmod
from taskgate import output
from taskgate_api.v1 import task_pb2

from .subscriptions import Background, unsubscribe

log = logging.getLogger("taskgate.notifier.output")


class Receiver(Protocol):
    """What a stream offers its live chunks to (subscriber.Subscriber)."""

    def offer_output(self, item: output.Live) -> bool: ...


@dataclass
class _Follow:
    """One watched task: its subscription (once made) and the streams of this process that follow it."""

    receivers: set[Receiver] = field(default_factory=set)
    ready: asyncio.Future[None] | None = None
    subscription: Any = None


class OutputHub:
    """The core subscriptions of the tasks whose output this process's streams follow, one per task."""

    def __init__(self, bus: busmod.Bus, *, replicated: bool = False) -> None:
        self._bus = bus
        self._replicated = replicated
        self._follows: dict[tuple[str, int], _Follow] = {}
        self._ending = Background()  # UNSUBs on their way

    async def read_after(
        self, user_id: str, task_id: int, after: int, *, final: bool = False
    ) -> task_pb2.OutputChunk | None:
        """The task's next stored chunk after sequence `after`, None when there is none. From the stream's leader when
        `final` (before a terminal event: it has every acknowledged chunk) or when the stream has replicas (a replica
        answering a direct get may lag a moment); else a direct get."""
        return await output.read_after(self._bus, user_id, task_id, after, consistent=final or self._replicated)

    async def follow(self, user_id: str, task_id: int, receiver: Receiver) -> None:
        """Offers `receiver` every chunk of the task stored from now on (the subscription is in place on return)."""
        key = (user_id, task_id)
        follow = self._follows.get(key)
        if follow is None:
            follow = self._follows[key] = _Follow()
            follow.ready = asyncio.get_running_loop().create_future()
            follow.receivers.add(receiver)
            try:
                follow.subscription = await self._bus.nc.subscribe(
                    busmod.output_live_subject(user_id, task_id), cb=self._deliver(task_id, follow)
                )
                await self._bus.nc.flush()  # the server has the interest: a chunk stored from here on reaches us
                follow.ready.set_result(None)
            except BaseException as exc:
                if self._follows.get(key) is follow:
                    del self._follows[key]
                follow.ready.set_exception(exc if isinstance(exc, Exception) else RuntimeError("follow cancelled"))
                follow.ready.exception()  # retrieved here: a stream that shared it raises its own copy
                raise
            return
        follow.receivers.add(receiver)
        assert follow.ready is not None
        try:
            await asyncio.shield(follow.ready)
        except BaseException:
            follow.receivers.discard(receiver)
            raise

    def unfollow(self, user_id: str, task_id: int, receiver: Receiver) -> None:
        """Stops offering chunks to `receiver`; the task's subscription ends with its last receiver (its UNSUB sent
        from a task of its own: a stream ended by a cancellation still leaves nothing behind)."""
        key = (user_id, task_id)
        follow = self._follows.get(key)
        if follow is None:
            return
        follow.receivers.discard(receiver)
        if follow.receivers:
            return
        del self._follows[key]  # a stream that starts from now on makes its own subscription
        if follow.subscription is not None:
            self._ending.spawn(unsubscribe(follow.subscription), "notifier-output-unfollow")

    def _deliver(self, task_id: int, follow: _Follow) -> Callable[[Msg], Awaitable[None]]:
        async def deliver(msg: Msg) -> None:
            item = output.live(msg)
            if item is None or item.chunk.task_id != str(task_id):
                log.error("undecodable output chunk dropped", extra={"subject": msg.subject})
                return
            for receiver in list(follow.receivers):
                receiver.offer_output(item)

        return deliver

    @property
    def followed(self) -> int:
        """How many tasks this process follows (tests and gauges)."""
        return len(self._follows)
