"""Terminal events straight to the WatchTask streams: a committer's hint (taskgate.wire.ended) read from the table.

The relay's pass (NOTIFY, a transaction, a JetStream publish and its ack, the consumer's delivery) stays the way every
event reaches every stream, and the safety net: this only takes a terminal event to this process's WatchTask streams
of its task sooner. A hint names a task and a version; the event itself is that version's row in PostgreSQL (so a
hint cannot forge anything), read only when a stream of this process watches the task, the hints that arrive while
a read runs going together in the next read. A stream drops whichever copy comes second by its version.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

import asyncpg
from nats.aio.msg import Msg

from services.notifier.event_feed import EventHub
from taskgate import bus as busmod
from taskgate.store import events as event_store
from taskgate.wire import ended
from taskgate.wire import events as event_wire

log = logging.getLogger("taskgate.notifier.ended")


class EndedHints:
    """Follows the ended hints for one hub's WatchTask streams."""

    def __init__(self, pool: asyncpg.Pool, hub: EventHub) -> None:
        self._pool = pool
        self._hub = hub
        self._asked: set[tuple[int, int]] = set()
        self._reader: asyncio.Task[None] | None = None
        self._sub: Any = None

    async def start(self, bus: busmod.Bus) -> None:
        self._sub = await bus.nc.subscribe(ended.SUBJECTS, cb=self._on_hint)

    async def stop(self) -> None:
        if self._sub is not None:
            with contextlib.suppress(Exception):
                await self._sub.unsubscribe()
            self._sub = None
        if self._reader is not None:
            self._reader.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._reader

    async def _on_hint(self, msg: Msg) -> None:
        found = ended.parse(msg.subject)
        if found is None or not self._hub.watching(found[0]):
            return
        self._asked.add(found)
        if self._reader is None or self._reader.done():
            self._reader = asyncio.create_task(self._read(), name="notifier-ended")

    async def _read(self) -> None:
        while self._asked:
            asked, self._asked = self._asked, set()
            try:
                rows = await event_store.events_at(self._pool, sorted(asked))
            except (asyncpg.PostgresError, asyncpg.InterfaceError, OSError, TimeoutError):
                log.warning("ended hints' read failed; the relay brings those events", exc_info=True)
                continue
            for row in rows:
                self._hub.offer_task(event_wire.message(row))
