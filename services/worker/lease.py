"""Keeping what this worker holds: its running attempts' leases, ack waits and progress, and its registry row."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Awaitable, Callable
from typing import Protocol

import asyncpg

from services.worker.consumer import Level
from services.worker.run import ACTOR
from services.worker.runstate import Run
from taskgate import bus as busmod
from taskgate import loops, telemetry
from taskgate.config import WorkerSettings
from taskgate.model import TaskRow
from taskgate.store import workers

log = logging.getLogger("taskgate.worker")

CONSUMER_STATS_SECONDS = 10.0  # how often a worker reads its consumers' pending counts (gauges) on its beats


class Check(Protocol):
    """A refused renewal or progress write: look at the row (read unless given), stop the run if it is not its own."""

    def __call__(self, run: Run, why: str, row: TaskRow | None = None) -> Awaitable[None]: ...


class Heartbeat:
    """One statement per beat for all of this worker: every heartbeat_seconds it renews each running attempt's lease,
    writes the progress that is due and records the registry row; between beats, one statement writes the progress
    that came due (each task's at most once per progress_interval_seconds, its newest value), renewing those leases.
    Such writes are at most once per progress_flush_seconds: each task is due at its own time (an interval after its
    last write), so a fleet's writes go in small batches spread over the interval, not one burst per interval."""

    def __init__(
        self,
        *,
        pool: asyncpg.Pool,
        bus: busmod.Bus,
        settings: WorkerSettings,
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
        self._check = check
        self._gauges = gauges
        self.use_cuda = use_cuda
        self._stats: asyncio.Task[None] | None = None
        self._wake = asyncio.Event()
        self._armed = False  # the loop already waits to write progress: a new step need not wake it
        self._next_write = 0.0  # monotonic: a progress write waits progress_flush_seconds after the last one
        self._next_beat = 0.0  # monotonic: when the next full beat is due
        self._stats_due = 0.0  # monotonic: when the consumer gauges are read next

    def progressed(self) -> None:
        """A run has new progress to write: wakes the loop, unless it already waits to write some."""
        if not self._armed:
            self._wake.set()

    async def loop(self) -> None:
        """Beats until cancelled, writing due progress in between; a failed statement is logged and the next tried."""
        self._next_beat = time.monotonic() + self.settings.heartbeat_seconds
        await loops.repeat(
            self._due,
            every=0.0,
            wake=self._wake,
            log=log,
            failed="heartbeat failed",
            extra=lambda: {"worker": self.worker_id},
            traceback=True,
        )

    async def _due(self) -> float:
        """The beat or the progress write that is due, if one is; the seconds until the next one is due."""
        beat_every = self.settings.heartbeat_seconds
        due = [
            at
            for run in self.runs.values()
            if (at := run.progress_at(self.settings.progress_interval_seconds)) is not None
        ]
        self._armed = bool(due)
        write_at = max(min(due), self._next_write) if due else None
        beat_at = self._next_beat
        if write_at is not None and abs(write_at - beat_at) <= beat_every / 4:
            beat_at = write_at  # a beat and a progress write close together go as one statement
        at = beat_at if write_at is None else min(beat_at, write_at)
        now = time.monotonic()
        if at > now:
            return at - now
        full = now >= beat_at
        if full:
            self._next_beat = now + beat_every
        await self.beat(full=full)
        return 0.0

    async def beat(self, *, full: bool = True) -> None:
        """One statement: with `full`, every running attempt's renewal and the registry row, else only the attempts
        whose progress is due; each due progress rides along (its write renews its lease too)."""
        now = time.monotonic()
        interval = self.settings.progress_interval_seconds
        flush = min(self.settings.progress_flush_seconds, interval)
        runs = list(self.runs.values())
        attempts: list[workers.BeatAttempt] = []
        named: list[tuple[Run, int | None, int]] = []  # each run named, the progress it carries, the one before
        carried = self._carried(runs, now, interval, flush)
        for run in runs:
            percent = run.percent if run.task.id in carried else None
            # a soft-cancelled run renews too: its lease holds the tenant's slot until it ends
            if percent is not None or (full and run.stopped_by is None):
                attempts.append(workers.BeatAttempt(run.task.id, run.attempt, percent))
                named.append((run, percent, run.written))
            elif full:
                named.append((run, None, run.written))  # not renewed (stopping), its message's ack wait still is
        written = asyncio.Event()
        for run, percent, _ in named:
            if percent is not None:
                run.written, run.last_write, run.writing = percent, now, written
        if any(percent is not None for _, percent, _ in named):
            self._next_write = now + flush
        try:
            renewed = await workers.beat(
                self.pool,
                attempts,
                lease_seconds=self.settings.lease_seconds,
                worker=self._registration() if full else None,
                actor=ACTOR,
            )
        except BaseException:
            for run, percent, before in named:
                if percent is not None and run.written == percent:
                    run.written = before  # not written: the next write carries it again
            raise
        finally:
            # the interval counts from when the statement ended: as the database stamps them, two writes of a task
            # are never closer than the interval, however long this one waited for its connection or its locks
            done = time.monotonic()
            for run, percent, _ in named:
                if percent is not None:
                    run.last_write = done
            if any(percent is not None for _, percent, _ in named):
                self._next_write = done + flush
            written.set()
        checks = []
        for run, percent, _ in named:
            got = renewed.get(run.task.id)
            if run.stopped_by is not None and percent is None:
                continue  # not renewed: nothing to check
            if got is None:
                checks.append(self._check(run, "lease renewal refused"))
            elif percent is not None and not got.progressed:
                checks.append(self._check(run, "progress write refused"))  # the row is read: the beat returns none
        if checks:
            for failure in await asyncio.gather(*checks, return_exceptions=True):
                if isinstance(failure, Exception):
                    log.warning(
                        "lease check failed", extra={"worker": self.worker_id, "error": type(failure).__name__}
                    )
        # A renewed lease outlives the message's ack wait unless that is restarted too. One after the other, not
        # gathered: each is a publish into the client's buffer that does not wait on the server, and a task per
        # message (100 a beat) cost more than the publishes.
        failed: str | None = None
        for run, _, _ in named:
            if run.owns_message:
                try:
                    await run.msg.in_progress()
                except Exception as exc:
                    failed = type(exc).__name__
        if failed is not None:
            log.warning("ack wait renewal failed", extra={"worker": self.worker_id, "error": failed})
        if full:
            self._beaten()

    @staticmethod
    def _carried(runs: list[Run], now: float, interval: float, flush: float) -> set[int]:
        """The tasks whose progress this statement writes: those due, the longest due first, at most the runs' share
        of a flush (running x flush / interval): tasks that came due together (started together) spread over the
        interval's flushes, and stay spread, each written an interval after its last write."""
        due = sorted(
            ((at, run.task.id) for run in runs if (at := run.progress_at(interval)) is not None and at <= now),
        )
        share = math.ceil(len(runs) * flush / interval) if 0 < flush < interval else len(due)
        return {task_id for _, task_id in due[: max(1, share)]}

    def _beaten(self) -> None:
        telemetry.WORKER_HEARTBEAT.set(time.time())
        self._gauges()
        if self.use_cuda:
            import torch

            for index in range(torch.cuda.device_count()):
                telemetry.GPU_MEMORY.labels(f"cuda:{index}").set(torch.cuda.memory_allocated(index))
        now = time.monotonic()
        # off the heartbeat's path (a slow NATS must not delay renewals), and not every beat: three JetStream API
        # calls and their decoding for two gauges
        if now >= self._stats_due and (self._stats is None or self._stats.done()):
            self._stats_due = now + CONSUMER_STATS_SECONDS
            self._stats = asyncio.create_task(self._consumer_stats())

    async def register(self) -> None:
        """Writes the registry row alone: what this worker serves and runs now."""
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
