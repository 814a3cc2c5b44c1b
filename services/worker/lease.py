"""Keeping what this worker holds: each running attempt's lease and ack wait, and the worker's registry row."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable

import asyncpg

from services.worker.consumer import Level
from services.worker.run import Run
from taskgate import bus as busmod
from taskgate import store, telemetry
from taskgate.config import Settings
from taskgate.store import workers
from taskgate.waiting import cancelling

log = logging.getLogger("taskgate.worker")

Check = Callable[[Run, str], Awaitable[None]]


class Heartbeat:
    """Every heartbeat_seconds: renews each running attempt's lease and ack wait, then the registry row and gauges."""

    def __init__(
        self,
        *,
        pool: asyncpg.Pool,
        bus: busmod.Bus,
        settings: Settings,
        worker_id: str,
        levels: list[Level],
        runs: dict[int, Run],
        registration: Callable[[], workers.Registration],
        check: Check,
        gauges: Callable[[], None],
        use_cuda: bool,
    ) -> None:
        self.pool = pool
        self.bus = bus
        self.settings = settings
        self.worker_id = worker_id
        self.levels = levels
        self.runs = runs
        self._registration = registration
        self._check = check  # a refused renewal: look at the row, stop the run if the task is no longer its
        self._gauges = gauges
        self.use_cuda = use_cuda
        self._stats: asyncio.Task[None] | None = None

    async def loop(self) -> None:
        """Beats until cancelled; a failed beat is logged and the next one tried."""
        while True:
            await asyncio.sleep(self.settings.heartbeat_seconds)
            try:
                await self.beat()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                if cancelling():
                    raise asyncio.CancelledError from exc
                log.warning("heartbeat failed", extra={"worker": self.worker_id}, exc_info=True)

    async def beat(self) -> None:
        """One heartbeat."""
        renewals = await asyncio.gather(*(self.renew(run) for run in list(self.runs.values())), return_exceptions=True)
        for failure in renewals:
            if isinstance(failure, Exception):
                log.warning("lease renewal failed", extra={"worker": self.worker_id, "error": type(failure).__name__})
        await self.register()
        telemetry.WORKER_HEARTBEAT.set(time.time())
        self._gauges()
        if self.use_cuda:
            import torch

            for index in range(torch.cuda.device_count()):
                telemetry.GPU_MEMORY.labels(f"cuda:{index}").set(torch.cuda.memory_allocated(index))
        if self._stats is None or self._stats.done():  # off the heartbeat's path: a slow NATS must not delay renewals
            self._stats = asyncio.create_task(self._consumer_stats())

    async def renew(self, run: Run) -> None:
        """Extends the run's lease (fenced by its attempt) and its message's ack wait, while they are still its own."""
        renewing = run.stopped_by is None  # a soft-cancelled run too: its lease holds the tenant's slot until it ends
        if renewing and not await store.renew_lease(self.pool, run.task.id, attempt=run.attempt, lease_seconds=self.settings.lease_seconds):
            await self._check(run, "lease renewal refused")
        if run.owns_message:
            await run.msg.in_progress()

    async def register(self) -> None:
        """Writes the registry row: what this worker serves and runs now."""
        await workers.register(self.pool, self._registration())

    def background(self) -> list[asyncio.Task[None]]:
        """The consumer-stats task in flight, if any, for shutdown to stop."""
        return [self._stats] if self._stats is not None else []

    async def _consumer_stats(self) -> None:
        for level in self.levels:
            with contextlib.suppress(Exception):
                info = await self.bus.js.consumer_info(busmod.TASKS_STREAM, level.consumer, timeout=1.0)
                telemetry.CONSUMER_PENDING.labels(level.consumer).set(info.num_pending or 0)
                telemetry.CONSUMER_ACK_PENDING.labels(level.consumer).set(info.num_ack_pending or 0)
