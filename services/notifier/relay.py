"""The event relay: task_event rows to JetStream in version order, publish then record, never skipping one."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import asyncpg
import nats.errors
import nats.js.errors
from opentelemetry.trace import Span, SpanKind

from services.notifier import outbox
from taskgate import bus as busmod
from taskgate import loops, telemetry, tracing
from taskgate.config import NotifierSettings
from taskgate.store import events as event_store
from taskgate.waiting import cancelling
from taskgate.wire import events as event_wire

log = logging.getLogger("taskgate.notifier.relay")


@dataclass(frozen=True, slots=True)
class TestSignals:
    """What a notifier lets a test hold or await (taskgate.signals): nothing in production."""

    __test__ = False  # not a pytest class
    # awaited after a relay pass published its messages and before it commits, with the relayed ids (crash tests block
    # here)
    before_commit: Callable[[Sequence[int]], Awaitable[None]] | None = None


class EventRelay:
    """Publishes unpublished events, inserts their webhook deliveries, and marks them published, in one transaction."""

    def __init__(
        self,
        settings: NotifierSettings,
        pool: asyncpg.Pool,
        bus: busmod.Bus,
        *,
        on_deliveries: Callable[[], None] | None = None,
        on_relayed: Callable[[Sequence[event_store.RelayEvent]], None] | None = None,
        signals: TestSignals | None = None,
    ) -> None:
        self._settings = settings
        self._pool = pool
        self._bus = bus
        self._on_deliveries = on_deliveries
        self._on_relayed = on_relayed  # a pass's rows once committed (the output webhooks of opted-in tasks)
        self.wake = asyncio.Event()
        self._signals = signals or TestSignals()
        self._lag_due = 0.0  # the event loop's time: when the relay lag gauge is read next

    def notify(self) -> None:
        """Wakes the relay (a NOTIFY arrived or a reconnect may have missed some)."""
        self.wake.set()

    async def run(self) -> None:
        """Relays on every wake-up and on a catch-up period, until cancelled."""
        await loops.repeat(
            self._pass,
            every=self._settings.relay_scan_interval_seconds,
            wake=self.wake,
            log=log,
            failed="relay pass failed",
            survives=(OSError, asyncpg.PostgresError, asyncpg.InterfaceError, nats.errors.Error),
        )

    async def _pass(self) -> None:
        """Relays until a pass comes back short of a full batch; the relay lag gauge once per scan period, not per pass
        (under load a pass per NOTIFY made it a round trip per event)."""
        while await self.relay_once() >= self._settings.relay_batch_size:
            pass
        loop = asyncio.get_running_loop()
        if loop.time() >= self._lag_due:
            telemetry.RELAY_LAG.set(await event_store.relay_lag(self._pool))
            self._lag_due = loop.time() + self._settings.relay_scan_interval_seconds

    async def relay_once(self) -> int:
        """One pass over the oldest unpublished events; returns how many it relayed."""
        created = 0
        relayed_rows: list[event_store.RelayEvent] = []
        async with self._pool.acquire() as conn, conn.transaction():
            # the lock and the events in one round trip: the streams wait for the publish that follows
            relay_time, rows = await event_store.lock_and_take(conn, limit=self._settings.relay_batch_size)
            if relay_time is None:
                return 0  # another replica is relaying; it was woken by the same NOTIFY
            if not rows:
                return 0
            # one span per event in its task's trace (none when tracing is off); the message and the webhook continue it
            spans = [_relay_span(r) for r in rows] if tracing.enabled() else []
            traces = [tracing.carrier_of(s) for s in spans]
            done: list[int] = []
            try:
                # publish first: the streams see the events while the deliveries are written (a pass that fails after
                # publishing is published again, deduplicated by Nats-Msg-Id)
                done = await self._publish([r.event for r in rows], traces)
                created = await outbox.write(
                    conn, rows, first_delay=self._settings.webhook_schedule_seconds[0], traces=traces
                )
                if self._signals.before_commit is not None:
                    await self._signals.before_commit(done)
                if done:
                    await event_store.mark_published(conn, done, at=relay_time)
                    relayed_rows = rows[: len(done)]  # `done` is a prefix of the rows, in id order
            finally:
                relayed = set(done)
                for row, started in zip(rows, spans, strict=False):
                    tracing.end(started, error=None if row.event.id in relayed else "not relayed in this pass")
        telemetry.EVENTS_RELAYED.inc(len(done))
        if created and self._on_deliveries is not None:
            self._on_deliveries()
        if relayed_rows and self._on_relayed is not None:
            self._on_relayed(relayed_rows)
        # A short pass after a failure must not loop at once: report "not a full batch".
        return len(done) if len(done) == len(rows) else 0

    async def _publish(
        self, events: Sequence[event_store.Event], traces: Sequence[tracing.Carrier | None] = ()
    ) -> list[int]:
        """Publishes in id order, pipelined; returns the ids of the longest prefix that JetStream acknowledged.

        Stopping at the first failure keeps each task's versions in order: a later version is never recorded before
        an earlier one, and anything after the failure is published again (deduplicated by Nats-Msg-Id).
        """
        timeout = self._settings.relay_publish_timeout_seconds
        futures: list[asyncio.Future[Any]] = []
        done: list[int] = []
        try:
            async with asyncio.timeout(timeout):  # waiting for room (too many acks outstanding): the pass's bound
                for i, event in enumerate(events):
                    trace = traces[i] if traces else None
                    fut = await event_wire.publish_async(self._bus, event, trace_context=trace)
                    if fut is None:
                        log.error(
                            "event has no valid subject; recorded without publishing", extra={"event_id": event.id}
                        )
                        fut = _resolved()
                    futures.append(fut)
        except TimeoutError:
            log.warning("relay publish stalled", extra={"published": len(futures), "of": len(events)})
        except (nats.errors.Error, nats.js.errors.Error) as exc:
            if cancelling():  # publish_async turns a cancellation into TooManyStalledMsgsError
                raise asyncio.CancelledError from exc
            log.warning("relay publish failed", extra={"error": f"{type(exc).__name__}: {exc}"[:300]})
        if futures:
            await asyncio.wait(futures, timeout=timeout)
        for event, fut in zip(events, futures, strict=False):
            if not fut.done() or fut.cancelled() or fut.exception() is not None:
                error = "timeout" if not fut.done() else repr(fut.exception())
                log.warning("relay publish not acknowledged", extra={"event_id": event.id, "error": error[:300]})
                break
            done.append(event.id)
        for fut in futures:
            fut.cancel()
        return done


def _relay_span(row: event_store.RelayEvent) -> Span | None:
    event = row.event
    return tracing.start(
        f"relay {event.to_status.value}",
        parent=row.trace_context,
        kind=SpanKind.PRODUCER,
        attributes={tracing.TASK_ID: str(event.task_id), "taskgate.version": event.version, "messaging.system": "nats"},
    )


def _resolved() -> asyncio.Future[Any]:
    fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
    fut.set_result(None)
    return fut
