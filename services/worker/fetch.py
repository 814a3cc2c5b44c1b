"""What to take next: dispatch messages while a slot is free, weighted across priorities, the rest handed back.

A task that lost a worker runs alone (migration 0047): while one runs here nothing else is taken, and when the claim
says one waits for this worker ('alone'), it takes nothing new until it holds no task, then takes from that task's
level only, one message, whose claim gets it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any

from nats.aio.msg import Msg

from services.worker.consumer import Level, Puller, Weighted, make_levels
from taskgate import bus as busmod
from taskgate import loops
from taskgate.config import WorkerSettings

log = logging.getLogger("taskgate.worker")

Start = Callable[["SlotTicket", Level, Msg], Coroutine[Any, Any, None]]
Spawn = Callable[[Coroutine[Any, Any, Any]], object]


@dataclass(eq=False)
class Slot:
    """One concurrent task's place, from its claim to its final write (its device phase takes a device, devices.py)."""

    index: int
    busy: bool = False
    pool: str = ""  # "": the worker's shared slots; a chat model's id: one of that model's sequences


@dataclass(eq=False)
class SlotTicket:
    """One message's ticket for a slot; releasing it twice frees the slot once, never a later ticket's."""

    slot: Slot
    released: bool = False


class Fetcher:
    """Pulls dispatch messages from this worker's (model, priority) levels and starts one per free slot."""

    def __init__(
        self,
        *,
        bus: busmod.Bus,
        settings: WorkerSettings,
        worker_id: str,
        models: list[str],
        slots: int,
        start: Start,
        spawn: Spawn,
        changed: Callable[[], None],
        pools: dict[str, int] | None = None,
    ) -> None:
        self.bus = bus
        self.settings = settings
        self.worker_id = worker_id
        self.models = models
        # `slots` in all; `pools`: the models whose slots are their own (a chat model's sequences), the rest shared
        own = pools or {}
        shared = slots - sum(own.values())
        self.slots = [Slot(i) for i in range(shared)]
        for model_id, count in own.items():
            self.slots += [Slot(len(self.slots), pool=model_id) for _ in range(count)]
        self._pools = set(own)
        self.levels = make_levels(models, settings.priority_weights)
        self.puller = Puller(bus.nc, self.levels, self._on_delivery, settings.worker_fetch_linger_seconds)
        self._draining = asyncio.Event()
        self._start = start
        self._spawn = spawn
        self._changed = changed  # free slots or draining changed: the gauges follow
        self._ready: list[tuple[Level, Msg]] = []
        self._wake = asyncio.Event()
        self._capped_until: dict[str, float] = {}
        self._alone: SlotTicket | None = None  # a run alone: nothing else is taken until its ticket is released
        self._drain_for: Level | None = None  # a task to run alone waits in this level for this worker
        self._drain_empty_at: float | None = None  # when this worker was first found empty while draining for it

    async def start(self) -> None:
        """Makes sure every level's durable consumer exists, then opens this worker's pull inboxes."""
        for model_id in self.models:
            for level in self.levels:
                if level.model_id == model_id:
                    await busmod.ensure_task_consumer(self.bus, self.settings, model_id, level.priority)
        await self.puller.start()

    @property
    def draining(self) -> bool:
        return self._draining.is_set()

    def stop(self) -> None:
        """Takes no more messages: the loop hands back what it holds and ends."""
        self._draining.set()
        self._wake.set()

    async def close(self) -> None:
        """Closes the pull inboxes."""
        await self.puller.close()

    def free_slots(self, model_id: str | None = None) -> list[Slot]:
        """The slots no message holds (of those a task of `model_id` may take, when given)."""
        if model_id is None:
            return [slot for slot in self.slots if not slot.busy]
        pool = model_id if model_id in self._pools else ""
        return [slot for slot in self.slots if not slot.busy and slot.pool == pool]

    def release(self, ticket: SlotTicket) -> None:
        """Frees a ticket's slot; only the first release of a ticket counts."""
        if not ticket.released:
            ticket.released = True
            ticket.slot.busy = False
            self._changed()
            self._wake.set()

    def run_alone(self, ticket: SlotTicket) -> None:
        """`ticket`'s task runs alone: nothing else is taken until it is released."""
        if not ticket.released:
            self._alone = ticket
            self._changed()

    def drain_for(self, level: Level) -> None:
        """A task to run alone waits for this worker in `level`: nothing new is taken until every slot is free, then one
        message of `level` (given up when none comes within a lease)."""
        if self._drain_for is None:
            self._drain_for, self._drain_empty_at = level, None
            log.info("draining to run a task alone", extra={"worker": self.worker_id, "consumer": level.consumer})
            self._changed()

    @property
    def held_alone(self) -> bool:
        """Whether this worker takes nothing now: a task runs alone here, or it drains for one and still holds tasks."""
        if self._alone is not None and self._alone.released:
            self._alone = None
        return self._alone is not None or (self._drain_for is not None and self._busy())

    def _shut(self, level: Level) -> bool:
        """Whether `level` gives nothing now (a run alone, or a drain for another level or not yet empty)."""
        if self.held_alone:
            return True
        if self._drain_for is None:
            return False
        now = time.monotonic()
        if self._drain_empty_at is None:
            self._drain_empty_at = now
        elif now - self._drain_empty_at > self.settings.lease_seconds:
            log.info("no message came to run a task alone; taking any again", extra={"worker": self.worker_id})
            self._drain_for = None
            return False
        return level is not self._drain_for

    def _busy(self) -> bool:
        return any(slot.busy for slot in self.slots)

    def cap(self, model_id: str, delay: float) -> None:
        """The model's concurrency cap is reached: leave its levels alone for `delay` seconds."""
        self._capped_until[model_id] = time.monotonic() + delay

    async def loop(self) -> None:
        """Takes messages until draining (a failed pass logged, the next a linger later), then hands back the ones it
        holds."""
        await loops.repeat(
            self._pass,
            every=self.settings.worker_fetch_linger_seconds,
            stop=self._draining,
            log=log,
            failed="dispatch failed",
            extra=lambda: {"worker": self.worker_id},
            level=logging.ERROR,
            traceback=True,
        )
        for _, msg in self._ready:
            await _bounce(msg)
        self._ready.clear()

    def _on_delivery(self, level: Level, msg: Msg | None) -> None:
        if msg is not None:
            if self.draining or not self.free_slots(level.model_id) or self._shut(level):
                self._spawn(_bounce(msg))
                return
            if not self._ready:
                self._take([(level, msg)])  # an idle worker's only message: no choice to make, start it now
            else:
                self._ready.append((level, msg))
        self._wake.set()  # this level's pull is spent: the loop opens the next one at once, not when another expires

    async def _pass(self) -> float:
        self._wake.clear()
        await self._once()
        return 0.0

    async def _once(self) -> None:
        ready, self._ready = self._ready, []
        if not self.free_slots() or self.held_alone:
            for _, msg in ready:
                await _bounce(msg)
            await self._wake.wait()
            return
        shut = [(lv, msg) for lv, msg in ready if self._shut(lv)]
        for _, msg in shut:
            await _bounce(msg)
        ready = [(lv, msg) for lv, msg in ready if not self._shut(lv)]
        now = time.monotonic()
        active = [lv for lv in self.levels if lv.paused_until <= now and self._capped_until.get(lv.model_id, 0.0) <= now
                  and self.free_slots(lv.model_id) and not self._shut(lv)]
        holding = {lv for lv, _ in ready}
        to_probe = [lv for lv in active if not lv.open(now) and lv not in holding]
        found = ready + (await self.puller.probe(to_probe) if to_probe else [])
        if found:
            self._take(found)
            return
        if self.draining:
            return
        now = time.monotonic()
        idle = [lv for lv in active if not lv.open(now)]
        if idle:
            await self.puller.linger(idle)
        if self._wake.is_set():
            return
        # Wake for the end of a pause, or when a lingering request should long have been answered (a lost answer).
        ends = [t for t in [*self._capped_until.values(), *(lv.paused_until for lv in self.levels)] if t > now]
        timeout = min([t - now + 0.001 for t in ends] + [2 * self.settings.worker_fetch_linger_seconds])
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._wake.wait(), timeout)

    def _take(self, found: list[tuple[Level, Msg]]) -> None:
        """Starts as many of the found messages as there are free slots, in weighted order; hands back the rest."""
        pending = list(found)
        has = {lv for lv, _ in pending}
        Weighted.forget([lv for lv in self.levels if lv not in has])
        while pending and not self.draining:
            startable = [
                lv
                for lv in dict.fromkeys(lv for lv, _ in pending)
                if self.free_slots(lv.model_id) and not self._shut(lv)
            ]
            if not startable:
                break
            level = Weighted.pick(startable)
            free = self.free_slots(level.model_id)
            index = next(i for i, (lv, _) in enumerate(pending) if lv is level)
            _, msg = pending.pop(index)
            ticket = SlotTicket(free[0])
            ticket.slot.busy = True
            self._spawn(self._start(ticket, level, msg))
            if self._drain_for is not None:  # the drain's one message: its claim takes the task to run alone
                self._drain_for = None
                break
        for _, msg in pending:
            self._spawn(_bounce(msg))
        self._changed()


async def _bounce(msg: Msg) -> None:
    """Hands back a message this worker has no room for, for the next worker (or itself) to take."""
    with contextlib.suppress(Exception):
        await msg.nak()
