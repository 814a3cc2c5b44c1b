"""Pulling dispatch messages from the durable consumers: one pull inbox per (model, priority), weighted choice.

A worker with a free slot keeps one lingering pull request open on every level (a level whose pull just delivered
opens its next at once), so a new message is delivered the moment it is stored, never after another level's pull
expires. When a slot frees, it probes every level at once with no-wait pulls and picks among
the levels that answered with a message by smooth weighted round robin, so HIGH goes first but LOW never starves.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from taskgate import bus as busmod

log = logging.getLogger("taskgate.worker.consumer")

_STATUS = "Status"
_NO_MESSAGES = {"404", "408"}  # no message now / the lingering request expired


@dataclass(eq=False)
class Level:
    """One durable consumer (model, priority) and this worker's pull inbox on it."""

    model_id: str
    priority: int
    weight: int
    consumer: str
    credit: int = 0
    sub: Subscription | None = None
    inbox: str = ""
    waiter: asyncio.Future[Msg | None] | None = None  # a probe waiting for its answer
    busy_until: float = 0.0  # a request is open on the server until then (monotonic)
    paused_until: float = 0.0

    def open(self, now: float) -> bool:
        """Whether a pull request of ours is (probably) still open on the server."""
        return now < self.busy_until


class Weighted:
    """Smooth weighted round robin over the levels that have a message; ties go to the higher priority."""

    @staticmethod
    def forget(empty: list[Level]) -> None:
        """Levels found empty lose their credit, so a level that comes back starts even with the rest."""
        for level in empty:
            level.credit = 0

    @staticmethod
    def pick(candidates: list[Level]) -> Level:
        """Chooses one of the levels that have a message and updates the credits."""
        total = sum(level.weight for level in candidates)
        for level in candidates:
            level.credit += level.weight
        best = max(candidates, key=lambda lv: (lv.credit, lv.priority))
        best.credit -= total
        return best


@dataclass
class Puller:
    """Pull requests and their answers for all levels of this worker; deliveries of lingering pulls are handed on."""

    nc: NATS
    levels: list[Level]
    on_delivery: Callable[[Level, Msg | None], None]  # a message, or None when a lingering request ended empty
    linger_seconds: float  # also how long a probe may take and how long a level that answered with an error rests
    _closed: bool = field(default=False, init=False)

    async def start(self) -> None:
        """Subscribes one inbox per level."""
        for level in self.levels:
            level.inbox = self.nc.new_inbox()
            level.sub = await self.nc.subscribe(level.inbox, cb=self._callback(level))

    async def close(self) -> None:
        """Unsubscribes: the server drops pull requests nobody listens to any more."""
        self._closed = True
        for level in self.levels:
            if level.waiter is not None and not level.waiter.done():
                level.waiter.set_result(None)
            if level.sub is not None:
                try:
                    await level.sub.unsubscribe()
                except Exception:  # a closed connection has nothing left to undo
                    log.debug("unsubscribe failed", extra={"consumer": level.consumer})
                level.sub = None

    def _callback(self, level: Level) -> Callable[[Msg], Awaitable[None]]:
        async def on_msg(msg: Msg) -> None:
            self._answer(level, msg)

        return on_msg

    def _answer(self, level: Level, msg: Msg) -> None:
        level.busy_until = 0.0
        waiter, level.waiter = level.waiter, None
        answer: Msg | None = msg
        if is_status(msg):
            answer = None
            status = msg.headers.get(_STATUS) if msg.headers else None
            if status not in _NO_MESSAGES:
                level.paused_until = time.monotonic() + self.linger_seconds
                log.warning("pull refused", extra={"consumer": level.consumer, "status": status})
        if waiter is not None and not waiter.done():
            waiter.set_result(answer)
        elif not self._closed or answer is not None:
            self.on_delivery(level, answer)

    async def _request(self, level: Level, body: dict[str, object], open_for: float) -> None:
        level.busy_until = time.monotonic() + open_for
        subject = f"$JS.API.CONSUMER.MSG.NEXT.{busmod.TASKS_STREAM}.{level.consumer}"
        await self.nc.publish(subject, json.dumps(body).encode(), reply=level.inbox)

    async def probe(self, levels: list[Level]) -> list[tuple[Level, Msg]]:
        """Asks each level for one message without waiting on the server; returns the levels that had one."""
        loop = asyncio.get_running_loop()
        waiters: list[tuple[Level, asyncio.Future[Msg | None]]] = []
        for level in levels:
            waiter: asyncio.Future[Msg | None] = loop.create_future()
            level.waiter = waiter
            await self._request(level, {"batch": 1, "no_wait": True}, self.linger_seconds)
            waiters.append((level, waiter))
        got: list[tuple[Level, Msg]] = []
        for level, waiter in waiters:
            try:
                msg = await asyncio.wait_for(asyncio.shield(waiter), self.linger_seconds)
            except TimeoutError:
                if level.waiter is waiter:
                    level.waiter = None  # a late answer arrives as a delivery
                continue
            if msg is not None:
                got.append((level, msg))
        return got

    async def linger(self, levels: list[Level]) -> None:
        """Opens a lingering pull request on each level: the next message is delivered as soon as it is stored."""
        expires = int(self.linger_seconds * 1e9)
        for level in levels:
            await self._request(level, {"batch": 1, "expires": expires}, 2 * self.linger_seconds)


def is_status(msg: Msg) -> bool:
    """Whether a delivery is a status answer (no message, expired request) rather than a task message."""
    return bool(msg.headers and _STATUS in msg.headers)


def make_levels(model_ids: list[str], weights: tuple[int, int, int]) -> list[Level]:
    """One level per (model, priority), highest priority first."""
    from taskgate.states import Priority

    by_priority = {Priority.HIGH: weights[0], Priority.NORMAL: weights[1], Priority.LOW: weights[2]}
    return [
        Level(model_id, priority, max(1, by_priority[priority]), busmod.consumer_name(model_id, priority))
        for priority in (Priority.HIGH, Priority.NORMAL, Priority.LOW)
        for model_id in model_ids
    ]
