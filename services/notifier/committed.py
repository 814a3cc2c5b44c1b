"""A small statement's events straight to the WatchTask streams: each row as written, in the NOTIFY its transaction
sent on commit (functions/task_history.sql, channel `taskgate_event_row`).

The relay's pass (NOTIFY, a transaction, a JetStream publish and its ack, the consumer's delivery) stays the way every
event reaches every stream, and the safety net: this only takes an event to this process's WatchTask streams of its
task sooner, the end included (a worker's commit of it is at the stream before the worker has heard its commit
back). PostgreSQL delivers it only once the transaction commits, so a stream is never handed a version that was not
committed; only a database session can send one (and a session could write the event rows themselves), so nothing a
service's NATS credentials can publish reaches a stream this way. Notifications of one task come in commit order, so
in version order; the hub hands a version to a task's streams once, whichever copy (this one or the relay's) comes
first. A row too long for a payload comes as its task and version: read from the table, only when a stream of this
process watches the task, the ones that arrive while a read runs going together in the next read.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from datetime import datetime
from typing import Any

import asyncpg

from services.notifier.event_feed import EventHub
from taskgate.store import events as event_store
from taskgate.wire import events as event_wire

log = logging.getLogger("taskgate.notifier.committed")

CHANNEL = "taskgate_event_row"


class CommittedEvents:
    """Hands the events a NOTIFY brings to one hub's WatchTask streams of their tasks."""

    def __init__(self, pool: asyncpg.Pool, hub: EventHub) -> None:
        self._pool = pool
        self._hub = hub
        self._asked: set[tuple[int, int]] = set()
        self._reader: asyncio.Task[None] | None = None

    async def stop(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._reader

    def notified(self, payload: str | None) -> None:
        """One NOTIFY's payload (the Listener's handler; None after it (re)connected: what it missed, the relay
        brings)."""
        if payload is None:
            return
        try:
            row: dict[str, Any] = json.loads(payload)
            task_id, version = int(row["task_id"]), int(row["version"])
        except (ValueError, TypeError, KeyError):
            log.error("undecodable event notification dropped")
            return
        if not self._hub.watching(task_id):
            return
        if "id" not in row:  # too long for a payload: read from the table
            self._asked.add((task_id, version))
            if self._reader is None or self._reader.done():
                self._reader = asyncio.create_task(self._read(), name="notifier-committed")
            return
        try:
            row["at"] = datetime.fromisoformat(row["at"])
            event = event_store.Event.from_record(row)
        except (ValueError, TypeError, KeyError):
            log.error("undecodable event notification dropped", extra={"task_id": str(task_id)})
            return
        self._hub.offer_task(event_wire.message(event))

    async def _read(self) -> None:
        while self._asked:
            asked, self._asked = self._asked, set()
            try:
                rows = await event_store.events_at(self._pool, sorted(asked))
            except (asyncpg.PostgresError, asyncpg.InterfaceError, OSError, TimeoutError):
                log.warning("a notified event's read failed; the relay brings it", exc_info=True)
                continue
            for row in rows:
                self._hub.offer_task(event_wire.message(row))
