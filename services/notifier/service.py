"""The notifier process: event relay, webhook sender and TaskEvents streams over one set of backends."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
import secrets
import socket
from dataclasses import dataclass, field

import asyncpg
import grpc

from services.notifier import committed as committed_events
from services.notifier.committed import CommittedEvents
from services.notifier.event_feed import EventHub
from services.notifier.output_feed import OutputHub
from services.notifier.output_hooks import OutputHooks
from services.notifier.progress_feed import ProgressHub
from services.notifier.relay import EventRelay, TestSignals
from services.notifier.streams import SERVICE, TaskEventsService, register
from services.notifier.webhooks import WebhookSender
from taskgate import results, runtime, server
from taskgate.auth import REVOKED_CHANNEL, Authenticator
from taskgate.config import NotifierSettings
from taskgate.listen import Listener
from taskgate.store.pool import create_pool
from taskgate.throttle import Throttle

log = logging.getLogger("taskgate.notifier")

EVENT_CHANNEL = "taskgate_event"
WEBHOOK_CHANNEL = "taskgate_webhook"
LISTEN_READY_SECONDS = 5.0
STOP_GRACE_SECONDS = 1.0
# The event path's own connections (the relay's pass, the reads of notified events too long for a payload): never
# queued behind the streams' reads. A burst of WatchTask streams opening (each reads its row, its ETA, its history)
# holds every connection of the shared pool with more reads waiting; on that pool the relay and the (then) ended hints'
# reads waited in the same queue, and a burst of 1,000 terminal events reached 314 of its 1,000 streams in 30 s (0 of
# 1,000 with 10,000 streams opening).
EVENT_PATH_CONNECTIONS = 2


@dataclass
class NotifierHandle:
    """A running notifier: its gRPC port, its parts (for tests), and how to stop or crash it."""

    port: int
    backends: runtime.Backends
    relay: EventRelay
    sender: WebhookSender
    hub: EventHub
    listener: Listener
    grpc_server: grpc.aio.Server
    health: server.Health
    owns_backends: bool
    tasks: list[asyncio.Task[None]] = field(default_factory=list)
    ended: bool = False
    event_pool: asyncpg.Pool | None = None  # the relay's and the notified reads' connections (EVENT_PATH_CONNECTIONS)
    output_hub: OutputHub | None = None
    committed: CommittedEvents | None = None
    progress_hub: ProgressHub | None = None
    output_hooks: OutputHooks | None = None

    async def stop(self) -> None:
        """Graceful: readiness off, streams ended (UNAVAILABLE with where to resume), loops stopped, attempts in flight
        finished, connections closed."""
        if self.ended:
            return
        self.ended = True
        try:
            await server.mark_not_serving(self.health)
            self.hub.close_streams()  # each stream ends with a status saying so and where to resume, not a bare cancel
            await self.grpc_server.stop(STOP_GRACE_SECONDS)
            await self._cancel_loops()
            if self.output_hooks is not None:
                await self.output_hooks.stop()
            await self.sender.stop()
            if self.committed is not None:
                await self.committed.stop()
            if self.progress_hub is not None:
                await self.progress_hub.stop()
            await self.hub.stop()
        finally:
            if self.event_pool is not None:
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(self.event_pool.close(), 5)
            if self.owns_backends:
                await self.backends.close()
        log.info("notifier stopped")

    async def kill(self) -> None:
        """Like a crash: nothing is finished or committed (crash tests); owned connections are dropped at once."""
        if self.ended:
            return
        self.ended = True
        self.listener.terminate()
        await self.health.stop_checking()
        if self.owns_backends:
            self.backends.pool.terminate()
        if self.event_pool is not None:
            self.event_pool.terminate()
        await self._cancel_loops()
        if self.output_hooks is not None:
            await self.output_hooks.stop()
        await self.sender.kill()
        await self.grpc_server.stop(None)
        if self.owns_backends:
            with contextlib.suppress(Exception):
                await self.backends.bus.nc.close()
        else:
            if self.committed is not None:
                await self.committed.stop()
            await self.hub.stop()

    async def _cancel_loops(self) -> None:
        await runtime.stop_tasks(self.tasks)


async def start(
    settings: NotifierSettings, backends: runtime.Backends | None = None, *, signals: TestSignals | None = None
) -> NotifierHandle:
    """Starts the relay, the webhook sender and the TaskEvents server; `backends` is shared if given, else owned;
    `signals`: a test's TestSignals."""
    owns = backends is None
    b = backends if backends is not None else await runtime.connect(settings, "notifier")
    owner = f"notifier-{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}"
    outputs = results.result_store(settings, b.bus)
    sender = WebhookSender(settings, b.pool, owner, outputs=outputs)
    event_pool = await create_pool(b.database_url, EVENT_PATH_CONNECTIONS)
    hub = EventHub(b.bus, settings.event_feed_heartbeat_seconds)
    output_hub = OutputHub(b.bus, replicated=settings.stream_replicas > 1)
    output_hooks = OutputHooks(settings, sender, hub, output_hub)  # task.output webhooks of the tasks that opted in
    relay = EventRelay(
        settings, event_pool, b.bus, on_deliveries=sender.notify, on_relayed=output_hooks.relayed, signals=signals
    )
    await hub.start()
    committed = CommittedEvents(event_pool, hub)  # a small statement's events to WatchTask streams on its commit
    throttle = Throttle.of(settings)
    authenticator = Authenticator(
        b.pool, settings.api_key_pepper, settings.api_key_cache_seconds, throttle=throttle, service=SERVICE
    )
    listener = Listener(
        b.database_url,
        {
            EVENT_CHANNEL: lambda _: relay.notify(),
            WEBHOOK_CHANNEL: lambda _: sender.notify(),
            REVOKED_CHANNEL: authenticator.revoked,
            committed_events.CHANNEL: committed.notified,
        },
    )
    progress_hub = ProgressHub(b.bus)  # running tasks' progress at each step, straight from their workers
    service = TaskEventsService(
        settings,
        b.pool,
        hub,
        authenticator,
        throttle,
        outputs=outputs,
        output_hub=output_hub,
        progress_hub=progress_hub,
    )
    tasks: list[asyncio.Task[None]] = []  # the loops, once started: liveness watches them
    probes = server.Probes(pool=b.pool, bus=b.bus, loops=lambda: tasks)
    grpc_server, port, health_servicer = await server.start_server(
        settings, settings.notifier_port, register(service), probes
    )
    tasks += [
        asyncio.create_task(listener.run(), name="notifier-listen"),
        asyncio.create_task(relay.run(), name="notifier-relay"),
        asyncio.create_task(sender.run(), name="notifier-webhooks"),
    ]
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(listener.connected.wait(), LISTEN_READY_SECONDS)
    log.info("notifier started", extra={"port": port, "owner": owner})
    return NotifierHandle(
        port, b, relay, sender, hub, listener, grpc_server, health_servicer, owns, tasks, output_hub=output_hub,
        committed=committed, progress_hub=progress_hub, event_pool=event_pool, output_hooks=output_hooks,
    )


def tune_gc(settings: NotifierSettings) -> None:
    """The process's full garbage collections made rarer (notifier_gc_full_threshold). A full collection walks the whole
    heap, which 10,000 open streams make large: at Python's default (10) they were most of an idle notifier's CPU (a
    pass of ~1.5 s about every 10 s; streams phase, 10,000 idle streams: 0.18 cores, 0.105 at 100). The young ones too
    (notifier_gc_young_threshold): a keep-alive tick's burst of wake-ups ran one every few hundred streams."""
    _young, middle, _full = gc.get_threshold()
    gc.set_threshold(settings.notifier_gc_young_threshold, middle, settings.notifier_gc_full_threshold)


async def main(settings: NotifierSettings) -> None:
    """Runs until SIGTERM/SIGINT, then stops gracefully."""
    tune_gc(settings)
    async with runtime.stop_signal() as stop:
        handle = await start(settings)
        await stop.wait()
        await handle.stop()
