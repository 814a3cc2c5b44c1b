"""Claiming for a dispatch message: one statement checks, caps, picks the fairest due task of the message's level,
claims and leases it."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import asyncpg
from nats.aio.msg import Msg

from services.worker.consumer import Level
from services.worker.run import ACTOR
from services.worker.settle import Fate, MessageAction, Step
from taskgate.config import WorkerSettings
from taskgate.model import TaskRow
from taskgate.store import ResultRef, workers
from taskgate.store.workers import Verdict
from taskgate.wire import dispatch

log = logging.getLogger("taskgate.worker")


@dataclass(frozen=True, slots=True)
class Claimed:
    """A new attempt held by this worker, and an earlier run's output for the same request if one was kept."""

    task: TaskRow
    reusable: ResultRef | None


@dataclass(frozen=True, slots=True)
class Declined:
    """A message this worker does not run, and what happens to it (task_id None: it names no task)."""

    task_id: int | None
    step: Step
    alone: bool = False  # a task that must run alone waits for this worker: take nothing new until it holds no task


class Claimer:
    """Claims on one connection kept for claims: a pool checkout less on the dispatch path."""

    def __init__(self, *, pool: asyncpg.Pool, settings: WorkerSettings, worker_id: str) -> None:
        self.pool = pool
        self.settings = settings
        self.worker_id = worker_id
        self._conn: asyncpg.Connection | None = None
        self._lock = asyncio.Lock()

    async def claim(self, level: Level, msg: Msg) -> Claimed | Declined:
        """A new attempt of the fairest due task of `msg`'s level (or of its own task), or why not (and what to do
        with the message)."""
        task_id = dispatch.task_id_of(msg.data)
        if task_id is None:
            log.warning("undecodable dispatch message dropped", extra={"consumer": level.consumer})
            return Declined(None, Step(MessageAction.TERM, None))
        retry_in = self.settings.worker_cap_retry_seconds
        try:
            async with self._connection() as conn:
                got = await workers.claim_for(
                    conn,
                    task_id,
                    model_id=level.model_id,
                    cap=self.settings.models[level.model_id].max_concurrency,
                    worker_id=self.worker_id,
                    lease_seconds=self.settings.lease_seconds,
                    actor=ACTOR,
                    reason="claimed",
                    max_worker_losses=self.settings.max_worker_losses,
                    cluster_cap=self.settings.cluster_cap,
                )
        except Exception:
            log.warning("claim failed; message redelivered later", extra={"task_id": str(task_id)}, exc_info=True)
            return Declined(task_id, Step(MessageAction.NAK, None, delay=retry_in))
        current = got.task
        match got.verdict:
            case Verdict.CLAIMED:
                assert current is not None
                return Claimed(current, got.reusable)
            case Verdict.CAPPED:
                return Declined(task_id, Step(MessageAction.NAK, Fate.CAPPED, delay=retry_in))
            case Verdict.EARLY:  # the message comes back when the level's first task is due
                return Declined(
                    task_id, Step(MessageAction.NAK, Fate.WAITING, delay=max(got.wait_seconds or 0.0, 0.001))
                )
            case Verdict.BUSY:
                return Declined(task_id, Step(MessageAction.NAK, Fate.WAITING, delay=retry_in))
            case Verdict.ALONE:
                log.info(
                    "draining to run a task alone",
                    extra={
                        "task_id": str(current.id) if current else None,
                        "worker": self.worker_id,
                        "consumer": level.consumer,
                    },
                )
                return Declined(task_id, Step(MessageAction.NAK, Fate.WAITING, delay=retry_in), alone=True)
            case Verdict.NOT_FOUND:
                return _drop(task_id, "no such task")
            case Verdict.OTHER_MODEL:
                model = current.model_id if current else None
                return _drop(task_id, "task of another model", model=model, consumer=level.consumer)
            case Verdict.FINISHED:
                return _drop(task_id, "task already finished", state=current.status.value if current else None)
            case Verdict.REFUSED:
                return _drop(
                    task_id,
                    "claim refused",
                    state=current.status.value if current else None,
                    holder=current.worker_id if current else None,
                )

    async def close(self) -> None:
        """Hands the kept connection back to the pool."""
        async with self._lock:
            await self._release()

    async def abandon(self) -> None:
        """A crash, for tests: hands the kept connection back without waiting for a claim in flight."""
        await self._release()

    @contextlib.asynccontextmanager
    async def _connection(self) -> AsyncIterator[asyncpg.Connection]:
        async with self._lock:
            if self._conn is None or not _usable(self._conn):
                await self._release()
                self._conn = await self.pool.acquire()
            try:
                yield self._conn
            except Exception:  # a broken connection is replaced on the next claim; a healthy one is simply re-taken
                await self._release()
                raise

    async def _release(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            with contextlib.suppress(Exception):
                await self.pool.release(conn)


def _drop(task_id: int, why: str, **extra: Any) -> Declined:
    """A message this worker will not run: acked, with one log line."""
    log.info("message dropped", extra={"task_id": str(task_id), "why": why, **extra})
    return Declined(task_id, Step(MessageAction.ACK, Fate.REFUSED))


def _usable(conn: asyncpg.Connection) -> bool:
    """False for a closed connection, and for a pool proxy whose connection asyncpg already detached."""
    try:
        return not conn.is_closed()
    except asyncpg.InterfaceError:
        return False
