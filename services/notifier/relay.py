"""The event relay: task_event rows to JetStream in version order, publish then record, never skipping one."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import asyncpg
import nats.errors
import nats.js.errors

from services.notifier import outbox
from services.notifier.events import event_proto, msg_id
from taskgate import bus as busmod
from taskgate import sql, telemetry
from taskgate.config import Settings
from taskgate.waiting import cancelling, woken

log = logging.getLogger("taskgate.notifier.relay")

# One relay pass at a time across all replicas: serialised passes keep each task's versions in order on the
# stream and give every pass a later relay time than the one before (WatchTasks cursors rely on that).
RELAY_LOCK_KEY = 0x7467_7265_6C61_7900  # "tgrelay"


class EventRelay:
    """Publishes unpublished events, inserts their webhook deliveries, and marks them published, in one transaction."""

    def __init__(
        self,
        settings: Settings,
        pool: asyncpg.Pool,
        bus: busmod.Bus,
        *,
        on_deliveries: Callable[[], None] | None = None,
    ) -> None:
        self._settings = settings
        self._pool = pool
        self._bus = bus
        self._on_deliveries = on_deliveries
        self.wake = asyncio.Event()
        # Test seam: awaited after a pass published its messages and before it commits (crash tests block here).
        self.before_commit: Callable[[Sequence[int]], Awaitable[None]] | None = None

    def notify(self) -> None:
        """Wakes the relay (a NOTIFY arrived or a reconnect may have missed some)."""
        self.wake.set()

    async def run(self) -> None:
        """Relays on every wake-up and on a catch-up period, until cancelled."""
        interval = self._settings.relay_scan_interval_seconds
        loop = asyncio.get_running_loop()
        lag_due = 0.0
        while True:
            self.wake.clear()
            try:
                while await self.relay_once() >= self._settings.relay_batch_size:
                    pass
                # once per scan period, not per pass: under load a pass per NOTIFY made this a round trip per event
                if loop.time() >= lag_due:
                    telemetry.RELAY_LAG.set(await self._pool.fetchval(sql.query("relay_lag")))
                    lag_due = loop.time() + interval
            except (OSError, asyncpg.PostgresError, asyncpg.InterfaceError, nats.errors.Error) as exc:
                if cancelling():
                    raise asyncio.CancelledError from exc
                log.warning("relay pass failed", extra={"error": f"{type(exc).__name__}: {exc}"[:300]})
            await woken(self.wake, interval)

    async def relay_once(self) -> int:
        """One pass over the oldest unpublished events; returns how many it relayed."""
        created = 0
        async with self._pool.acquire() as conn, conn.transaction():
            lock = await conn.fetchrow(sql.query("relay_lock"), RELAY_LOCK_KEY)
            assert lock is not None
            if not lock["locked"]:
                return 0  # another replica is relaying; it was woken by the same NOTIFY
            rows = await conn.fetch(sql.query("relay_take_events"), self._settings.relay_batch_size)
            if not rows:
                return 0
            created = await outbox.write(conn, rows, self._settings.webhook_schedule_seconds[0])
            done = await self._publish(rows)
            if self.before_commit is not None:
                await self.before_commit(done)
            if done:
                await conn.execute(sql.query("relay_mark_published"), done, lock["at"])
        telemetry.EVENTS_RELAYED.inc(len(done))
        if created and self._on_deliveries is not None:
            self._on_deliveries()
        # A short pass after a failure must not loop at once: report "not a full batch".
        return len(done) if len(done) == len(rows) else 0

    async def _publish(self, rows: Sequence[Any]) -> list[int]:
        """Publishes in id order, pipelined; returns the ids of the longest prefix that JetStream acknowledged.

        Stopping at the first failure keeps each task's versions in order: a later version is never recorded before
        an earlier one, and anything after the failure is published again (deduplicated by Nats-Msg-Id).
        """
        js = self._bus.js
        timeout = self._settings.relay_publish_timeout_seconds
        futures: list[asyncio.Future[Any]] = []
        done: list[int] = []
        try:
            for row in rows:
                try:
                    subject = busmod.event_subject(row["user_id"], row["task_id"])
                except ValueError:
                    log.error("event has no valid subject; recorded without publishing", extra={"event_id": row["id"]})
                    futures.append(_resolved())
                    continue
                futures.append(
                    await js.publish_async(
                        subject,
                        event_proto(row).SerializeToString(),
                        wait_stall=timeout,
                        headers={"Nats-Msg-Id": msg_id(row["task_id"], row["version"])},
                    )
                )
        except (nats.errors.Error, nats.js.errors.Error) as exc:
            if cancelling():  # publish_async turns a cancellation into TooManyStalledMsgsError
                raise asyncio.CancelledError from exc
            log.warning("relay publish failed", extra={"error": f"{type(exc).__name__}: {exc}"[:300]})
        if futures:
            await asyncio.wait(futures, timeout=timeout)
        for row, fut in zip(rows, futures, strict=False):
            if not fut.done() or fut.cancelled() or fut.exception() is not None:
                error = "timeout" if not fut.done() else repr(fut.exception())
                log.warning("relay publish not acknowledged", extra={"event_id": row["id"], "error": error[:300]})
                break
            done.append(row["id"])
        for fut in futures:
            fut.cancel()
        return done


def _resolved() -> asyncio.Future[Any]:
    fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
    fut.set_result(None)
    return fut
