"""A run's step checkpoints on the worker's side: the newest one read before the run (so it resumes there), the run's
own snapshots encoded and stored off the device thread while it goes on, and the last one deleted once the task ends.

Life cycle: a snapshot taken at a step end (services/worker/checkpoint.py) is encoded in a thread; its object name
(`checkpoints/<task>-a<attempt>-s<step>-<random>`) is written into the row's garbage list first, then the object is put
into the result store, then recorded on the row as the newest checkpoint — each statement guarded by the attempt (a
fenced-out attempt stores nothing, or deletes what it stored) — and the record returns the garbage to delete now (the
checkpoint it replaced among it). A worker killed between any two of these leaves only objects the row names. A later
attempt of the task — after a worker's death, a lost lease, a drain, a retryable failure — claims the row with its
checkpoint and resumes from it. Once the task has ended its worker deletes its checkpoints; those of a task ended
elsewhere (cancelled, timed out) go with the scheduler's retention scan.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass

import asyncpg

from services.worker import checkpoint, retry
from taskgate import results
from taskgate.model import TaskRow
from taskgate.store import workers

log = logging.getLogger("taskgate.worker")

CONTENT_TYPE = "application/vnd.taskgate.checkpoint+safetensors"


def object_name(task_id: int, attempt: int, step: int) -> str:
    """Where one snapshot is stored: unique to it, so no two writers ever share an object."""
    return f"checkpoints/{task_id}-a{attempt}-s{step}-{secrets.token_hex(6)}.safetensors"


@dataclass(frozen=True, slots=True)
class Kept:
    """A checkpoint recorded on the task row: for tests (TestSignals.checkpointed) and logs."""

    task_id: int
    attempt: int
    step: int
    uri: str
    device_seconds: float  # the attempt's device seconds when the snapshot was taken


async def load(store: results.ResultStore, task: TaskRow, within: float = 0.0) -> checkpoint.Snapshot | None:
    """The task's newest checkpoint, or None (none, gone, unreadable: the run starts from step 0, and says why); a
    store outage is ridden out for up to `within` seconds first (a lease: the heartbeat keeps it meanwhile)."""
    uri = task.checkpoint_uri
    if uri is None:
        return None

    async def read() -> bytes:
        return b"".join([chunk async for chunk in store.read(uri)])

    try:
        data = await retry.persist(within, "checkpoint", task.id, read)
        snapshot = await asyncio.to_thread(checkpoint.decode, data)
    except asyncio.CancelledError:
        raise
    except Exception as exc:  # gone, unreadable, a store outage: a checkpoint is never worth failing a run for
        log.warning(
            "checkpoint unreadable; the run starts from step 0",
            extra={"task_id": str(task.id), "uri": uri, "error": f"{type(exc).__name__}: {exc}"},
        )
        return None
    log.info(
        "resuming from a checkpoint", extra={"task_id": str(task.id), "attempt": task.attempt, "step": snapshot.step}
    )
    return snapshot


async def forget(pool: asyncpg.Pool, store: results.ResultStore, task: TaskRow | None) -> None:
    """Deletes an ended task's checkpoints (the newest and any garbage), then forgets them on the row (best effort:
    retention collects what is left)."""
    if task is None or not task.status.terminal or (task.checkpoint_uri is None and not task.checkpoint_garbage):
        return
    try:
        for uri in [*task.checkpoint_garbage, *([task.checkpoint_uri] if task.checkpoint_uri else [])]:
            with contextlib.suppress(results.ResultNotFound):
                await store.delete(uri)
        await workers.drop_checkpoint(pool, task.id)
    except Exception:
        log.warning("checkpoint not deleted; retention will", extra={"task_id": str(task.id)}, exc_info=True)


class Keeper:
    """One run's checkpoints as they are taken (a checkpoint.Capture for its device thread): the newest snapshot
    waiting is written, older waiting ones are dropped, one write at a time, on the event loop and a helper thread."""

    def __init__(
        self,
        *,
        pool: asyncpg.Pool,
        store: results.ResultStore,
        task: TaskRow,
        policy: checkpoint.Policy,
        device_seconds: Callable[[], float],
        kept: Callable[[Kept], None],
        loop: asyncio.AbstractEventLoop,
        start_step: int = 0,
    ) -> None:
        self.pool = pool
        self.store = store
        self.task = task
        self.timer = checkpoint.Timer(policy, start_step)
        self.newest: Kept | None = None  # the newest checkpoint this run recorded
        self._device_seconds = device_seconds  # the attempt's device seconds so far (thread-safe read)
        self._kept = kept
        self._loop = loop
        self._waiting: tuple[checkpoint.Snapshot, float] | None = None
        self._deleted: list[str] = []  # garbage deleted since the last record
        self._writer: asyncio.Task[None] | None = None

    # ---- the device thread's side ----

    def due(self, step: int, total: int) -> bool:
        return self.timer.due(step, total)

    def keep(self, snapshot: checkpoint.Snapshot) -> None:
        self.timer.taken(snapshot.step)
        seconds = self._device_seconds()
        self._loop.call_soon_threadsafe(self._offer, snapshot, seconds)

    # ---- the loop's side ----

    def ask_on_stop(self) -> None:
        """The run's next step end takes a snapshot before it stops (a drain)."""
        self.timer.ask_on_stop()

    def _offer(self, snapshot: checkpoint.Snapshot, seconds: float) -> None:
        self._waiting = (snapshot, seconds)
        if self._writer is None or self._writer.done():
            self._writer = asyncio.create_task(self._write_waiting(), name=f"checkpoint-{self.task.id}")

    async def _write_waiting(self) -> None:
        while self._waiting is not None:
            (snapshot, seconds), self._waiting = self._waiting, None
            try:
                await self._write(snapshot, seconds)
            except asyncio.CancelledError:
                raise
            except Exception:  # a checkpoint is an optimisation: the run goes on without it
                log.warning(
                    "checkpoint not stored", extra={"task_id": str(self.task.id), "step": snapshot.step}, exc_info=True
                )

    async def _write(self, snapshot: checkpoint.Snapshot, seconds: float) -> None:
        task = self.task
        began = time.monotonic()
        data = await asyncio.to_thread(snapshot.encode)
        name = object_name(task.id, task.attempt, snapshot.step)
        # named on the row before it is stored: a worker killed at any point leaves no object that no row names
        if not await workers.name_checkpoint(self.pool, task.id, attempt=task.attempt, uri=self.store.uri_of(name)):
            return  # fenced out: this attempt no longer runs the task
        stored = await self.store.put(name, data, CONTENT_TYPE)
        garbage = await workers.record_checkpoint(
            self.pool, task.id, attempt=task.attempt, uri=stored.uri, step=snapshot.step, deleted=self._deleted
        )
        if garbage is None:  # fenced out meanwhile: the object stays named as garbage, and goes now
            with contextlib.suppress(results.ResultNotFound):
                await self.store.delete(stored.uri)
            return
        self._deleted = []
        for old in garbage:
            with contextlib.suppress(results.ResultNotFound):
                await self.store.delete(old)
            self._deleted.append(old)  # the next record drops them from the row's garbage
        self.newest = Kept(task.id, task.attempt, snapshot.step, stored.uri, seconds)
        log.info(  # one line per checkpoint interval (30 s by default); the fault suite checks resumes against them
            "checkpoint stored",
            extra={
                "task_id": str(task.id), "attempt": task.attempt, "step": snapshot.step, "bytes": len(data),
                "seconds": round(time.monotonic() - began, 3),
            },
        )
        self._kept(self.newest)

    async def flush(self) -> None:
        """Waits for the snapshots taken so far to be stored (a stopped run's last one before its task is released)."""
        while self._writer is not None and not self._writer.done():
            await asyncio.shield(self._writer)

    async def close(self) -> None:
        """Drops the snapshots not yet being written (the run ended: they are of no further use) and lets the one being
        written finish (cut short, it would leave an object no row names)."""
        self._waiting = None
        await self.flush()
