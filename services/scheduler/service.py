"""The scheduler service: the scan loop that moves stuck tasks on, the queue gauges, and the TaskAdmin server."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime

import asyncpg
import grpc

from services.scheduler.admin import TaskAdminService
from services.scheduler.retention import RetentionScan
from services.scheduler.scans import (
    Action,
    CreatedScan,
    DeadLetterScan,
    HoldScan,
    LeaseScan,
    PreemptScan,
    ProcessingTimeoutScan,
    QueuedScan,
    QueueTTLScan,
    Scan,
    ScanContext,
    TaskScan,
    WorkerScan,
    count,
)
from taskgate import bus as busmod
from taskgate import loops, runtime, server, telemetry
from taskgate.config import SchedulerSettings
from taskgate.store import maintenance
from taskgate_api.v1 import admin_pb2_grpc

log = logging.getLogger("taskgate.scheduler")


@dataclass
class ScanReport:
    """What one pass of every scan did: tasks per action, scans that failed (name -> error), and whether any
    scan filled its batch (so another pass should follow at once)."""

    actions: Counter[Action] = field(default_factory=Counter)
    failed: dict[str, str] = field(default_factory=dict)
    full: bool = False

    def __getitem__(self, action: Action) -> int:
        return self.actions[action]


class Scheduler:
    """Runs every scan in turn, on a timer (run) or on demand (run_once), and refreshes the queue gauges."""

    def __init__(self, settings: SchedulerSettings, pool: asyncpg.Pool, bus: busmod.Bus) -> None:
        self.settings = settings
        self.pool = pool
        ctx = ScanContext(settings, pool, bus)
        # QUEUED and CREATED first: a task released by the lease scan in this pass is not re-published in it.
        self.task_scans: list[TaskScan] = [
            QueueTTLScan(ctx), QueuedScan(ctx), CreatedScan(ctx), LeaseScan(ctx), ProcessingTimeoutScan(ctx)
        ]
        self.retention = RetentionScan(ctx)
        self.scans: list[Scan] = [
            *self.task_scans, HoldScan(ctx), DeadLetterScan(ctx), WorkerScan(ctx), PreemptScan(ctx), self.retention
        ]
        self.passes = 0

    async def run_once(self, now: datetime | None = None) -> ScanReport:
        """One batch of every scan; `now` (default: the database's now()) lets tests move the clock."""
        report = ScanReport()
        for scan in self.scans:
            start = time.perf_counter()
            try:
                result = await scan.run(now)
            except Exception as exc:  # one failing scan (a backend down, a bad row) must not stop the others
                telemetry.SCHEDULER_SCAN_ERRORS.labels(scan.name).inc()
                expected = isinstance(exc, (asyncpg.PostgresError, *server.BACKEND_ERRORS))
                log.log(
                    logging.WARNING if expected else logging.ERROR,
                    "scan failed",
                    exc_info=None if expected else exc,
                    extra={"scan": scan.name, "error": type(exc).__name__},
                )
                report.failed[scan.name] = f"{type(exc).__name__}: {exc}"
                continue
            finally:
                telemetry.SCHEDULER_SCAN_SECONDS.labels(scan.name).observe(time.perf_counter() - start)
            count(result)
            report.actions.update(result.actions)
            report.full |= result.examined >= self.settings.scan_batch_size
        self.passes += 1
        if any(report.actions.values()):
            log.info("scan pass", extra={"actions": {a.value: n for a, n in report.actions.items() if n}})
        return report

    async def refresh_gauges(self) -> None:
        """Sets QUEUE_DEPTH, QUEUE_OLDEST_AGE and PROCESSING per model, and WORKERS_ALIVE."""
        seen = {load.model_id: load for load in await maintenance.queue_gauges(self.pool)}
        for model_id in set(self.settings.models) | set(seen):
            load = seen.get(model_id)
            telemetry.QUEUE_DEPTH.labels(model_id).set(load.queued if load else 0)
            telemetry.QUEUE_OLDEST_AGE.labels(model_id).set((load.oldest_queued_age or 0.0) if load else 0.0)
            telemetry.PROCESSING.labels(model_id).set(load.processing if load else 0)
        telemetry.WORKERS_ALIVE.set(
            await maintenance.workers_alive(self.pool, lease_seconds=self.settings.lease_seconds)
        )

    async def run(self, stop: asyncio.Event) -> None:
        """Scans every scan_interval_seconds (at once again while batches come back full) until `stop` is set."""
        # each scan's failure is its own (run_once logs it) and the gauges' too: anything else ends the loop
        await loops.repeat(
            self._pass,
            every=self.settings.scan_interval_seconds,
            stop=stop,
            log=log,
            failed="scan pass failed",
            survives=(),
        )

    async def _pass(self) -> float | None:
        """One pass of every scan, then the gauges; 0 (the next pass at once) when a batch came back full."""
        report = await self.run_once()
        try:
            await self.refresh_gauges()
        except Exception as exc:  # stale gauges are better than a stopped loop
            log.warning("gauges failed", extra={"error": type(exc).__name__})
        return 0.0 if report.full and not report.failed else None


@dataclass
class SchedulerHandle:
    """A running scheduler: its TaskAdmin port, the Scheduler (for run_once in tests), and stop()."""

    port: int
    scheduler: Scheduler
    backends: runtime.Backends
    _server: grpc.aio.Server
    _health: server.Health
    _stop: asyncio.Event
    _loop: asyncio.Task[None] | None
    _owns_backends: bool
    _listening: asyncio.Task[None]

    async def stop(self, grace: float = 5.0) -> None:
        """Stops the scan loop (a pass in flight gets `grace` seconds), then the server (in-flight calls get
        `grace` seconds), then the connections."""
        self._stop.set()
        try:
            await server.mark_not_serving(self._health)
            if self._loop is not None:
                try:
                    await asyncio.wait_for(self._loop, grace)
                except TimeoutError:
                    log.warning("scan pass cancelled at shutdown")
            await self._server.stop(grace)
        finally:
            await runtime.stop_tasks([self._listening])
            if self._owns_backends:
                await self.backends.close()


async def start(
    settings: SchedulerSettings, backends: runtime.Backends | None = None, *, scan_loop: bool = True
) -> SchedulerHandle:
    """Starts TaskAdmin on settings.scheduler_port and (unless scan_loop=False, for tests) the scan loop."""
    owns = backends is None
    b = backends if backends is not None else await runtime.connect(settings, "scheduler")
    scheduler = Scheduler(settings, b.pool, b.bus)
    admin = TaskAdminService(settings, b.pool, b.bus, scheduler.task_scans, scheduler.retention)

    def register(srv: grpc.aio.Server) -> Iterable[str]:
        admin_pb2_grpc.add_TaskAdminServicer_to_server(admin, srv)
        return ["taskgate.v1.TaskAdmin"]

    loops: list[asyncio.Task[None]] = []  # the scan loop, once started: liveness watches it
    probes = server.Probes(pool=b.pool, bus=b.bus, loops=lambda: loops)
    try:
        srv, port, health_servicer = await server.start_server(settings, settings.scheduler_port, register, probes)
    except BaseException:
        if owns:
            await b.close()
        raise
    stop = asyncio.Event()
    loop = asyncio.create_task(scheduler.run(stop), name="scheduler-loop") if scan_loop else None
    loops.extend([loop] if loop is not None else [])
    listening = asyncio.create_task(admin.auth.listener(b.database_url).run(), name="scheduler-revocations")
    return SchedulerHandle(port, scheduler, b, srv, health_servicer, stop, loop, owns, listening)


async def main(settings: SchedulerSettings) -> None:
    """Runs the scheduler until SIGTERM or SIGINT."""
    async with runtime.stop_signal() as stopping:
        handle = await start(settings)
        log.info("scheduler started", extra={"port": handle.port})
        await stopping.wait()
        await handle.stop()
