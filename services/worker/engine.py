"""The worker engine: takes dispatch messages when a slot is free, claims, runs, heartbeats, finishes, drains."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import enum
import json
import logging
import random
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, TypeVar

import asyncpg
from nats.aio.msg import Msg

from services.worker import runner as runmod
from services.worker.consumer import Level, Puller, Weighted, make_levels
from taskgate import bus as busmod
from taskgate import results, runtime, sql, store, telemetry
from taskgate.config import Settings
from taskgate.model import TaskRow, timestamp
from taskgate.runtime import Backends
from taskgate.server import BACKEND_ERRORS
from taskgate.states import Status
from taskgate.store import Move, Outcome
from taskgate.v1 import task_pb2, worker_pb2
from taskgate.waiting import cancelling

log = logging.getLogger("taskgate.worker")

ACTOR = "worker"
T = TypeVar("T")
ERROR_MSG_CHARS = 500


class Abort(enum.Enum):
    """Why a running attempt was told to stop, which decides what happens to its message."""

    CANCELED = "canceled"  # hard cancel: ack, discard the output
    TERMINAL = "terminal"  # the task ended elsewhere (timeout, failure): ack, discard
    LOST = "lost"  # another attempt holds the task: discard, leave the message to its owner
    REQUEUED = "requeued"  # released elsewhere and not yet claimed again: discard, nak for a prompt redelivery
    DRAIN = "drain"  # this worker is shutting down: release the task, nak
    KILLED = "killed"  # a simulated crash: touch nothing


@dataclass(frozen=True, slots=True)
class RunReport:
    """What became of one message this worker took: a log line and a signal tests can await."""

    task_id: int
    outcome: str
    attempt: int = 0
    steps_done: int = 0
    total_steps: int = 0
    steps_at_abort: int | None = None
    error_code: str | None = None
    delay: float | None = None


@dataclass(eq=False)
class Slot:
    """One concurrent run's place: a device and the single thread that runs generations on it."""

    index: int
    device: str
    executor: concurrent.futures.ThreadPoolExecutor
    busy: bool = False


@dataclass(eq=False)
class SlotHold:
    """One message's hold on a slot; releasing it twice frees the slot once, never a later holder's."""

    slot: Slot
    released: bool = False


@dataclass(eq=False)
class Run:
    """One claimed attempt running here."""

    task: TaskRow
    msg: Msg
    hold: SlotHold
    abort: threading.Event = field(default_factory=threading.Event)
    abort_reason: Abort | None = None
    steps_at_abort: int | None = None
    soft_canceled: bool = False
    finishing: bool = False
    steps_done: int = 0
    total_steps: int = 0
    written: int = 0
    last_write: float = field(default_factory=time.monotonic)
    writer: asyncio.Task[None] | None = None
    started: float = field(default_factory=time.monotonic)

    @property
    def attempt(self) -> int:
        """This run's fencing token: every write it makes is guarded by it."""
        return self.task.attempt

    @property
    def percent(self) -> int:
        """Progress of the denoising loop; 100 is kept for the finished task."""
        return min(99, self.steps_done * 100 // self.total_steps) if self.total_steps else 0

    def stop(self, reason: Abort) -> None:
        """Asks the run to stop at its next step; the first reason wins."""
        if self.abort_reason is None:
            self.abort_reason = reason
            self.steps_at_abort = self.steps_done
        self.abort.set()


@dataclass(frozen=True, slots=True)
class Reusable:
    """An earlier soft-cancelled run's output for the same request."""

    uri: str
    content_type: str
    size: int
    sha256: str


def backoff(settings: Settings, retry_count: int) -> float:
    """Delay before retry number retry_count + 1: doubling from retry_backoff_seconds, jittered, capped."""
    base = settings.retry_backoff_seconds * 2**retry_count
    jitter = random.uniform(1 - settings.retry_jitter, 1 + settings.retry_jitter)
    return min(settings.retry_backoff_max_seconds, base * jitter)


async def persist(within: float, what: str, task_id: int, action: Callable[[], Awaitable[T]]) -> T:
    """Retries a final write through a backend outage of up to `within` seconds (the heartbeat keeps the lease)."""
    deadline = time.monotonic() + within
    delay = 0.05
    while True:
        try:
            return await action()
        except BACKEND_ERRORS as exc:
            if time.monotonic() + delay > deadline:
                raise
            log.warning("final write failed; retrying", extra={"task_id": str(task_id), "what": what, "error": type(exc).__name__})
            await asyncio.sleep(delay)
            delay = min(2 * delay, 1.0)


def _task_id(data: bytes) -> int | None:
    """The task id of a dispatch message, or None when the message is not one (poison is dropped, not retried)."""
    try:
        text = task_pb2.TaskDispatch.FromString(data).task_id
    except Exception:
        return None
    if not text.isascii() or not text.isdigit():
        return None
    value = int(text)
    return value if 0 < value < 2**63 else None


def _usable(conn: asyncpg.Connection) -> bool:
    """False for a closed connection, and for a pool proxy whose connection asyncpg already detached."""
    try:
        return not conn.is_closed()
    except asyncpg.InterfaceError:
        return False


def _seconds(a: datetime | None, b: datetime | None) -> float | None:
    return (b - a).total_seconds() if a is not None and b is not None else None


class Worker:
    """Consumes the dispatch messages of its models and runs them, one per free slot."""

    def __init__(
        self,
        settings: Settings,
        backends: Backends,
        runners: dict[tuple[str, str], runmod.ModelRunner],
        devices: list[str],
        worker_id: str,
        models: list[str],
        use_cuda: bool = False,
    ) -> None:
        self.settings = settings
        self.pool = backends.pool
        self.bus = backends.bus
        self.results = results.result_store(settings, backends.bus)
        self.runners = runners
        self.worker_id = worker_id
        self.models = models
        self.use_cuda = use_cuda
        self.device = ",".join(sorted(set(devices)))
        self.slots = [
            Slot(i, device, concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=f"slot-{i}")) for i, device in enumerate(devices)
        ]
        self.levels = make_levels(models, settings.priority_weights)
        self.puller = Puller(backends.bus.nc, self.levels, self._on_delivery, settings.worker_fetch_linger_seconds)
        self.runs: dict[int, Run] = {}
        self.reports: list[RunReport] = []
        self.draining = False
        self.drain_requested = asyncio.Event()
        self._ready: list[tuple[Level, Msg]] = []
        self._wake = asyncio.Event()
        self._capped_until: dict[str, float] = {}
        self._tasks: set[asyncio.Task[Any]] = set()
        self._loops: list[asyncio.Task[None]] = []
        self._report_changed = asyncio.Event()
        self._drain_task: asyncio.Task[None] | None = None
        self._cancel_sub: Any = None
        self._killed = False
        self._claim_conn: asyncpg.Connection | None = None
        self._claim_lock = asyncio.Lock()
        self._stats: asyncio.Task[None] | None = None

    # ---- life cycle ----

    async def start(self) -> None:
        """Registers, subscribes to cancel signals, and starts fetching and heartbeating."""
        await self._beat_registry()
        for model_id in self.models:
            for level in self.levels:
                if level.model_id == model_id:
                    await busmod.ensure_task_consumer(self.bus, self.settings, model_id, level.priority)
        await self.puller.start()
        self._cancel_sub = await self.bus.nc.subscribe(busmod.CANCEL_SUBJECT, cb=self._on_cancel)
        self._loops = [
            asyncio.create_task(self._dispatch_loop(), name="worker-dispatch"),
            asyncio.create_task(self._heartbeat_loop(), name="worker-heartbeat"),
        ]
        self._gauges()
        log.info(
            "worker started",
            extra={"worker": self.worker_id, "models": self.models, "slots": len(self.slots), "device": self.device},
        )

    def begin_drain(self, grace: float | None = None) -> asyncio.Task[None]:
        """Stops taking work; running tasks get `grace` seconds, then are released to other workers."""
        if self._drain_task is None:
            seconds = self.settings.drain_grace_seconds if grace is None else grace
            self._drain_task = asyncio.create_task(self._drain(seconds), name="worker-drain")
            self.drain_requested.set()
        return self._drain_task

    async def _drain(self, grace: float) -> None:
        self.draining = True
        self._wake.set()
        log.info("draining", extra={"worker": self.worker_id, "running": len(self.runs), "grace_seconds": grace})
        with contextlib.suppress(Exception):
            await self._beat_registry()
        deadline = time.monotonic() + grace
        while self.runs and time.monotonic() < deadline:
            await self._wait_report(deadline - time.monotonic())
        for run in list(self.runs.values()):
            run.stop(Abort.DRAIN)
        while self._tasks:
            await asyncio.wait(set(self._tasks))

    async def close(self) -> None:
        """After a drain: stops the loops, unsubscribes, removes the registry row."""
        await self.begin_drain()
        await runtime.stop_tasks([*self._loops, *([self._stats] if self._stats else [])])
        await self.puller.close()
        if self._cancel_sub is not None:
            with contextlib.suppress(Exception):
                await self._cancel_sub.unsubscribe()
        async with self._claim_lock:
            await self._release_claim_connection()
        with contextlib.suppress(Exception):
            await self.pool.execute(sql.query("worker_delete"), self.worker_id)
        for slot in self.slots:
            slot.executor.shutdown(wait=False, cancel_futures=True)
        self._gauges()
        log.info("worker stopped", extra={"worker": self.worker_id})

    async def kill(self) -> None:
        """A crash, for tests: stops everything at once and releases nothing (leases and messages just expire)."""
        self._killed = True
        self.draining = True
        for run in self.runs.values():
            run.stop(Abort.KILLED)
        await runtime.stop_tasks([*self._loops, *self._tasks, *([self._stats] if self._stats else [])])
        await self._release_claim_connection()
        await self.puller.close()
        if self._cancel_sub is not None:
            with contextlib.suppress(Exception):
                await self._cancel_sub.unsubscribe()
        for slot in self.slots:
            slot.executor.shutdown(wait=False, cancel_futures=True)

    # ---- fetching ----

    def _free_slots(self) -> list[Slot]:
        return [slot for slot in self.slots if not slot.busy]

    def _on_delivery(self, level: Level, msg: Msg | None) -> None:
        if msg is not None:
            if self.draining or not self._free_slots():
                self._spawn(self._bounce(msg))
                return
            if not self._ready:
                self._take([(level, msg)])  # an idle worker's only message: no choice to make, start it now
                return
            self._ready.append((level, msg))
        self._wake.set()

    async def _bounce(self, msg: Msg) -> None:
        """Hands back a message this worker has no room for, for the next worker (or itself) to take."""
        with contextlib.suppress(Exception):
            await msg.nak()

    async def _dispatch_loop(self) -> None:
        while not self.draining:
            self._wake.clear()
            try:
                await self._dispatch_once()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                if cancelling():  # a client library reported our cancellation as its own error
                    raise asyncio.CancelledError from exc
                log.exception("dispatch failed", extra={"worker": self.worker_id})
                await asyncio.sleep(self.settings.worker_fetch_linger_seconds)
        for _, msg in self._ready:
            await self._bounce(msg)
        self._ready.clear()

    async def _dispatch_once(self) -> None:
        ready, self._ready = self._ready, []
        if not self._free_slots():
            for _, msg in ready:
                await self._bounce(msg)
            await self._wake.wait()
            return
        now = time.monotonic()
        active = [lv for lv in self.levels if lv.paused_until <= now and self._capped_until.get(lv.model_id, 0.0) <= now]
        holding = {lv for lv, _ in ready}
        to_probe = [lv for lv in active if not lv.open(now) and lv not in holding]
        found = ready + (await self.puller.probe(to_probe) if to_probe else [])
        if found:
            self._take(found)
            return
        if self.draining:
            return
        now = time.monotonic()
        idle = [lv for lv in active if not lv.open(now)]
        if idle:
            await self.puller.linger(idle)
        if self._wake.is_set():
            return
        # Wake for the end of a pause, or when a lingering request should long have been answered (a lost answer).
        ends = [t for t in [*self._capped_until.values(), *(lv.paused_until for lv in self.levels)] if t > now]
        timeout = min([t - now + 0.001 for t in ends] + [2 * self.settings.worker_fetch_linger_seconds])
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._wake.wait(), timeout)

    def _take(self, found: list[tuple[Level, Msg]]) -> None:
        """Starts as many of the found messages as there are free slots, in weighted order; hands back the rest."""
        pending = list(found)
        has = {lv for lv, _ in pending}
        Weighted.forget([lv for lv in self.levels if lv not in has])
        while pending:
            free = self._free_slots()
            if not free or self.draining:
                break
            level = Weighted.pick(list(dict.fromkeys(lv for lv, _ in pending)))
            index = next(i for i, (lv, _) in enumerate(pending) if lv is level)
            _, msg = pending.pop(index)
            hold = SlotHold(free[0])
            hold.slot.busy = True
            self._spawn(self._handle(hold, level, msg))
        for _, msg in pending:
            self._spawn(self._bounce(msg))
        self._gauges()

    def _spawn(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def _free(self, hold: SlotHold) -> None:
        # the slot is freed early (when generation ends) and again on the way out; only the first counts
        if not hold.released:
            hold.released = True
            hold.slot.busy = False
            self._gauges()
            self._wake.set()

    # ---- claiming ----

    async def _handle(self, hold: SlotHold, level: Level, msg: Msg) -> None:
        try:
            task_id = _task_id(msg.data)
            if task_id is None:
                log.warning("undecodable dispatch message dropped", extra={"consumer": level.consumer})
                await msg.term()
                return
            await self._claim_and_run(hold, level, msg, task_id)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("message handling failed", extra={"worker": self.worker_id})
        finally:
            self._free(hold)

    async def _drop(self, msg: Msg, task_id: int, why: str, **extra: Any) -> None:
        """Acks a message this worker will not run, with one log line."""
        await msg.ack()
        log.info("message dropped", extra={"task_id": str(task_id), "why": why, **extra})
        self._report(RunReport(task_id, "refused"))

    async def _claim_and_run(self, hold: SlotHold, level: Level, msg: Msg, task_id: int) -> None:
        spec = self.settings.models[level.model_id]
        try:
            async with self._claim_connection() as conn:
                preview = await conn.fetchrow(sql.query("worker_preview"), task_id)
                outcome = None
                if preview is not None and preview["model_id"] == level.model_id and not Status(preview["status"]).terminal:
                    outcome = await self._claim(conn, task_id, level.model_id, spec.max_concurrency)
        except Exception:
            log.warning("claim failed; message redelivered later", extra={"task_id": str(task_id)}, exc_info=True)
            await msg.nak(delay=self.settings.worker_cap_retry_seconds)
            return
        if preview is None:
            await self._drop(msg, task_id, "no such task")
            return
        if preview["model_id"] != level.model_id:
            await self._drop(msg, task_id, "task of another model", model=preview["model_id"], consumer=level.consumer)
            return
        if outcome is None and Status(preview["status"]).terminal:
            await self._drop(msg, task_id, "task already finished", state=preview["status"])
            return
        if outcome is None:
            delay = self.settings.worker_cap_retry_seconds
            self._capped_until[level.model_id] = time.monotonic() + delay
            await msg.nak(delay=delay)
            self._report(RunReport(task_id, "capped", delay=delay))
            return
        if not outcome.applied:
            current = outcome.task
            await self._drop(
                msg,
                task_id,
                "claim refused",
                rejection=outcome.rejection.value if outcome.rejection else None,
                state=current.status.value if current else None,
                holder=current.worker_id if current else None,
            )
            return
        task = outcome.task
        assert task is not None
        # Restart the ack wait now, so a redelivery after a crash comes after the lease has expired.
        await msg.in_progress()
        reusable = None
        if preview["result_uri"] is not None:
            reusable = Reusable(preview["result_uri"], preview["result_content_type"], preview["result_size"], preview["result_sha256"])
        run = Run(task, msg, hold)
        self.runs[task.id] = run
        self._gauges()
        wait = _seconds(task.queued_at or task.created_at, task.started_at)
        if wait is not None:
            telemetry.QUEUE_WAIT.labels(task.model_id).observe(max(0.0, wait))
        try:
            if self.draining:
                run.stop(Abort.DRAIN)
                await self._after_abort(run)
            elif reusable is not None:
                await self._finish_reused(run, reusable)
            else:
                await self._execute(run)
        finally:
            if run.writer is not None and not run.writer.done():
                run.writer.cancel()
            self.runs.pop(task.id, None)
            self._gauges()
            self._notify()

    @contextlib.asynccontextmanager
    async def _claim_connection(self) -> AsyncIterator[asyncpg.Connection]:
        """One connection kept for claims: a pool round trip (and its reset query) less on the dispatch path."""
        async with self._claim_lock:
            if self._claim_conn is None or not _usable(self._claim_conn):
                await self._release_claim_connection()
                self._claim_conn = await self.pool.acquire()
            try:
                yield self._claim_conn
            except Exception:  # a broken connection is replaced on the next claim; a healthy one is simply re-taken
                await self._release_claim_connection()
                raise

    async def _release_claim_connection(self) -> None:
        conn, self._claim_conn = self._claim_conn, None
        if conn is not None:
            with contextlib.suppress(Exception):
                await self.pool.release(conn)

    async def _claim(self, conn: asyncpg.Connection, task_id: int, model_id: str, cap: int) -> Outcome | None:
        """The guarded claim; None when the model's cap is reached (checked under a per-model lock)."""
        lease = self.settings.lease_seconds
        reason = "claimed"
        if cap <= 0:
            return await store.transition(conn, task_id, Move.CLAIM, self.worker_id, lease, actor=ACTOR, reason=reason)
        async with conn.transaction():
            await conn.execute(sql.query("worker_lock_model"), model_id)
            running = await conn.fetchval(sql.query("worker_count_running"), model_id, task_id)
            if running >= cap:
                return None
            return await store.transition(conn, task_id, Move.CLAIM, self.worker_id, lease, actor=ACTOR, reason=reason)

    # ---- running ----

    async def _execute(self, run: Run) -> None:
        task = run.task
        model_runner = self.runners[(task.model_id, run.hold.slot.device)]
        inp = runmod.RunInput(task.id, task.attempt, task.prompt, dict(task.request_payload))
        loop = asyncio.get_running_loop()

        def on_step(step: int, total: int) -> None:
            loop.call_soon_threadsafe(self._on_step, run, step, total)

        try:
            output = await loop.run_in_executor(run.hold.slot.executor, model_runner.generate, inp, on_step, run.abort.is_set)
        except runmod.RunAborted:
            self._free(run.hold)
            await self._after_abort(run)
            return
        except Exception as exc:
            self._free(run.hold)
            if run.abort_reason is not None:
                await self._after_abort(run)
            else:
                await self._after_failure(run, exc)
            return
        self._free(run.hold)
        telemetry.RUN_TIME.labels(task.model_id).observe(time.monotonic() - run.started)
        await self._finish(run, output)

    def _on_step(self, run: Run, step: int, total: int) -> None:
        run.steps_done, run.total_steps = step, total
        if (run.writer is None or run.writer.done()) and self._progress_due(run):
            run.writer = asyncio.create_task(self._write_progress(run))

    def _progress_due(self, run: Run) -> bool:
        if run.finishing or run.soft_canceled or run.abort_reason is not None:
            return False
        if run.steps_done >= run.total_steps:
            return False  # the final transition writes 100 a moment later
        pct = run.percent
        if pct <= run.written:
            return False
        return pct - run.written >= 10 or time.monotonic() - run.last_write >= self.settings.progress_interval_seconds

    async def _write_progress(self, run: Run) -> None:
        """Writes the newest progress while it is due; only the latest value is ever sent."""
        while self._progress_due(run):
            pct = run.percent
            run.written, run.last_write = pct, time.monotonic()
            try:
                out = await store.transition(
                    self.pool,
                    run.task.id,
                    Move.PROGRESS,
                    pct,
                    self.settings.lease_seconds,
                    actor=ACTOR,
                    reason="progress",
                    expected_attempt=run.attempt,
                )
            except Exception:
                log.warning("progress write failed", extra={"task_id": str(run.task.id)}, exc_info=True)
                return
            if not out.applied:
                await self._check(run, "progress write refused", out.task)
                return
            # The write extended the lease; the ack wait must not end before it.
            await run.msg.in_progress()

    async def _finish_writes(self, run: Run) -> None:
        """Stops progress writes before a final transition, so none lands after it."""
        run.finishing = True
        if run.writer is not None and not run.writer.done():
            with contextlib.suppress(Exception):
                await run.writer

    # ---- outcomes ----

    async def _persist(self, what: str, task_id: int, action: Callable[[], Awaitable[T]]) -> T:
        return await persist(self.settings.lease_seconds, what, task_id, action)

    async def _finish(self, run: Run, output: runmod.RunOutput) -> None:
        task = run.task
        if run.abort_reason is Abort.KILLED:
            return
        await self._finish_writes(run)
        name = f"{task.id}-a{task.attempt}.{output.extension}"
        stored = await self._persist("result", task.id, lambda: self.results.put(name, output.data, output.content_type))
        out = await self._succeed(run, stored.uri, stored.content_type, stored.size, stored.sha256, reused=False)
        row = out.task
        # A retried SUCCEED whose first try committed (its reply was lost) is refused, yet the result is ours.
        ours = row is not None and row.status is Status.SUCCEEDED and row.attempt == task.attempt and row.result_uri == stored.uri
        if out.applied or ours:
            await run.msg.ack()
            self._finished(run, row, "succeeded")
            return
        await self._refused_result(run, out, stored)

    async def _finish_reused(self, run: Run, reusable: Reusable) -> None:
        await self._finish_writes(run)
        out = await self._succeed(run, reusable.uri, reusable.content_type, reusable.size, reusable.sha256, reused=True)
        if out.applied:
            await run.msg.ack()
            self._finished(run, out.task, "reused")
            return
        await self._refused_result(run, out, None)

    async def _succeed(self, run: Run, uri: str, content_type: str, size: int, sha256: str, *, reused: bool) -> Outcome:
        """SUCCEED with a result, fenced by this run's attempt, retried through short backend outages."""
        task = run.task
        reason = "reused a soft-cancelled run's output" if reused else "finished"
        return await self._persist(
            "succeed",
            task.id,
            lambda: store.transition(
                self.pool, task.id, Move.SUCCEED, uri, content_type, size, sha256, reused,
                actor=ACTOR, reason=reason, expected_attempt=task.attempt,
            ),
        )

    async def _refused_result(self, run: Run, out: Outcome, stored: results.StoredResult | None) -> None:
        """The SUCCEED was refused: keep this run's output if its attempt was soft-cancelled, else delete it."""
        row = out.task
        soft = row is not None and row.attempt == run.attempt and row.status is Status.CANCELED and row.cancel_mode == "soft"
        if stored is not None and soft:
            kept = await self._persist(
                "reusable",
                run.task.id,
                lambda: self.pool.fetchval(
                    sql.query("worker_keep_reusable"),
                    run.task.id,
                    run.attempt,
                    stored.uri,
                    stored.content_type,
                    stored.size,
                    stored.sha256,
                ),
            )
            if kept is not None:
                await run.msg.ack()
                self._report_run(run, "soft_canceled")
                return
        if stored is not None:
            await self.results.delete(stored.uri)
        outcome = await self._settle_message(run, row)
        if outcome == "fenced":
            log.warning(
                "stale attempt's output discarded",
                extra={"task_id": str(run.task.id), "attempt": run.attempt, "current_attempt": row.attempt if row else None},
            )
        self._report_run(run, outcome)

    async def _settle_message(self, run: Run, row: TaskRow | None) -> str:
        """Acks, naks or leaves the message of a run whose task is no longer its to write; returns the outcome."""
        if row is None:
            await run.msg.ack()
            return "gone"
        if row.attempt != run.attempt:
            return "fenced"  # the message now belongs to the newer attempt's worker
        if row.status.terminal:
            await run.msg.ack()
            return "canceled" if row.status is Status.CANCELED else "terminal"
        if row.status is Status.QUEUED:
            await run.msg.nak()
            return "requeued"
        return "refused"

    async def _after_abort(self, run: Run) -> None:
        reason = run.abort_reason
        if reason is Abort.KILLED:
            return
        await self._finish_writes(run)
        if reason is Abort.DRAIN:
            out = await self._persist(
                "release",
                run.task.id,
                lambda: store.transition(
                    self.pool, run.task.id, Move.RELEASE, actor=ACTOR, reason="worker draining", expected_attempt=run.attempt
                ),
            )
            if out.applied:
                await run.msg.nak()
                self._report_run(run, "released")
            else:
                self._report_run(run, await self._settle_message(run, out.task))
            return
        if reason is Abort.LOST:
            log.warning("lease lost; output discarded", extra={"task_id": str(run.task.id), "attempt": run.attempt})
            self._report_run(run, "lost")
            return
        if reason is Abort.REQUEUED:
            await run.msg.nak()
            self._report_run(run, "requeued")
            return
        await run.msg.ack()
        self._report_run(run, "canceled" if reason is Abort.CANCELED else "terminal")

    async def _after_failure(self, run: Run, exc: BaseException) -> None:
        task = run.task
        retryable, code = runmod.classify(exc)
        message = f"{type(exc).__name__}: {exc}"[:ERROR_MSG_CHARS]
        log.warning(
            "run failed",
            extra={"task_id": str(task.id), "attempt": task.attempt, "error_code": code, "retryable": retryable},
            exc_info=not isinstance(exc, runmod.InjectedFailure),
        )
        await self._finish_writes(run)
        if retryable and task.retry_count < task.max_retries:
            delay = backoff(self.settings, task.retry_count)
            out = await self._persist(
                "retry",
                task.id,
                lambda: store.transition(
                    self.pool,
                    task.id,
                    Move.RETRY,
                    code,
                    message,
                    delay,
                    actor=ACTOR,
                    reason=f"retry {task.retry_count + 1} of {task.max_retries}",
                    expected_attempt=task.attempt,
                ),
            )
            row = out.task
            # A retried RETRY whose first try committed (its reply was lost) is refused, yet the move is ours.
            ours = row is not None and row.attempt == task.attempt and row.retry_count == task.retry_count + 1
            if out.applied or (ours and row is not None and row.status is Status.QUEUED):
                await run.msg.nak(delay=delay)
                self._report_run(run, "retried", error_code=code, delay=delay)
            else:
                self._report_run(run, await self._settle_message(run, out.task))
            return
        if retryable:
            out = await self._persist(
                "fail",
                task.id,
                lambda: store.fail_for_good(
                    self.pool,
                    task.id,
                    error_code=code,
                    error_msg=message,
                    reason="retries exhausted",
                    actor=ACTOR,
                    expected_attempt=task.attempt,
                ),
            )
            if out.applied:
                await self._publish_dead_letter(task, "retries exhausted", code, message)
                await run.msg.ack()
                self._finished(run, out.task, "dead", error_code=code)
            else:
                self._report_run(run, await self._settle_message(run, out.task))
            return
        out = await self._persist(
            "fail",
            task.id,
            lambda: store.transition(
                self.pool, task.id, Move.FAIL, code, message, actor=ACTOR, reason="permanent failure", expected_attempt=task.attempt
            ),
        )
        if out.applied:
            await run.msg.ack()
            self._finished(run, out.task, "failed", error_code=code)
        else:
            self._report_run(run, await self._settle_message(run, out.task))

    async def _publish_dead_letter(self, task: TaskRow, reason: str, code: str, message: str) -> None:
        body = {
            "task_id": str(task.id),
            "model_id": task.model_id,
            "user_id": task.user_id,
            "reason": reason,
            "error_code": code,
            "error_message": message,
            "attempt": task.attempt,
            "retry_count": task.retry_count,
            "at": datetime.now(UTC).isoformat(),
        }
        try:
            await self.bus.js.publish(
                busmod.dead_subject(task.model_id), json.dumps(body).encode(), headers={"Nats-Msg-Id": f"{task.id}.dead"}
            )
        except Exception:  # the dead_letter row is the record; the stream is a notification
            log.warning("dead-letter publish failed", extra={"task_id": str(task.id)}, exc_info=True)

    def _finished(self, run: Run, row: TaskRow | None, outcome: str, error_code: str | None = None) -> None:
        self._report_run(run, outcome, error_code=error_code)

    # ---- watching a running task ----

    async def _check(self, run: Run, why: str, row: TaskRow | None = None) -> None:
        """Reads the row after a refused write or a cancel signal and stops the run if the task is not ours to finish."""
        if run.finishing or run.abort_reason is not None:
            return
        if row is None:
            row = await store.get_task(self.pool, run.task.id)
        if row is None or row.attempt != run.attempt:
            log.warning("lease lost", extra={"task_id": str(run.task.id), "attempt": run.attempt, "why": why})
            run.stop(Abort.LOST)
        elif row.status is Status.CANCELED:
            if row.cancel_mode == "soft":
                run.soft_canceled = True  # finish; the output becomes reusable
            else:
                run.stop(Abort.CANCELED)
        elif row.status.terminal:
            run.stop(Abort.TERMINAL)
        elif row.status is not Status.PROCESSING:
            run.stop(Abort.REQUEUED)

    async def _on_cancel(self, msg: Msg) -> None:
        try:
            signal = task_pb2.CancelSignal.FromString(msg.data)
            task_id = int(signal.task_id)
        except Exception:
            return
        run = self.runs.get(task_id)
        if run is not None:
            self._spawn(self._check(run, "cancel signal"))

    async def _heartbeat_loop(self) -> None:
        while True:
            await asyncio.sleep(self.settings.heartbeat_seconds)
            try:
                await self._beat()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                if cancelling():
                    raise asyncio.CancelledError from exc
                log.warning("heartbeat failed", extra={"worker": self.worker_id}, exc_info=True)

    async def _beat(self) -> None:
        renewals = await asyncio.gather(*(self._renew(run) for run in list(self.runs.values())), return_exceptions=True)
        for failure in renewals:
            if isinstance(failure, Exception):
                log.warning("lease renewal failed", extra={"worker": self.worker_id, "error": type(failure).__name__})
        await self._beat_registry()
        telemetry.WORKER_HEARTBEAT.set(time.time())
        self._gauges()
        if self.use_cuda:
            import torch

            for index in range(torch.cuda.device_count()):
                telemetry.GPU_MEMORY.labels(f"cuda:{index}").set(torch.cuda.memory_allocated(index))
        if self._stats is None or self._stats.done():  # off the heartbeat's path: a slow NATS must not delay renewals
            self._stats = asyncio.create_task(self._consumer_stats())

    async def _consumer_stats(self) -> None:
        for level in self.levels:
            with contextlib.suppress(Exception):
                info = await self.bus.js.consumer_info(busmod.TASKS_STREAM, level.consumer, timeout=1.0)
                telemetry.CONSUMER_PENDING.labels(level.consumer).set(info.num_pending or 0)
                telemetry.CONSUMER_ACK_PENDING.labels(level.consumer).set(info.num_ack_pending or 0)

    async def _renew(self, run: Run) -> None:
        renewing = run.abort_reason is None and not run.soft_canceled
        if renewing and not await store.renew_lease(self.pool, run.task.id, run.attempt, self.settings.lease_seconds):
            await self._check(run, "lease renewal refused")
        if run.abort_reason not in (Abort.LOST, Abort.KILLED):
            await run.msg.in_progress()

    async def _beat_registry(self) -> None:
        await self.pool.execute(
            sql.query("worker_upsert"),
            self.worker_id,
            self.models,
            len(self.slots),
            len(self.runs),
            self.device,
            self.draining,
        )

    # ---- reporting ----

    def _gauges(self) -> None:
        telemetry.WORKER_RUNNING.set(len(self.runs))
        telemetry.WORKER_FREE_SLOTS.set(0 if self.draining else len(self._free_slots()))

    def _report_run(self, run: Run, outcome: str, error_code: str | None = None, delay: float | None = None) -> None:
        self._report(RunReport(run.task.id, outcome, run.attempt, run.steps_done, run.total_steps, run.steps_at_abort, error_code, delay))

    def _report(self, report: RunReport) -> None:
        self.reports.append(report)
        del self.reports[:-1000]
        log.info(
            "task handled",
            extra={
                "task_id": str(report.task_id),
                "outcome": report.outcome,
                "attempt": report.attempt,
                "steps": report.steps_done,
                "worker": self.worker_id,
            },
        )
        self._notify()

    def _notify(self) -> None:
        self._report_changed.set()
        self._report_changed = asyncio.Event()

    async def _wait_report(self, seconds: float) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._report_changed.wait(), max(0.0, seconds))

    async def wait_for(self, predicate: Callable[[RunReport], bool], within: float = 10.0) -> RunReport:
        """The first report matching `predicate`, waiting up to `within` seconds for it (a test signal)."""
        deadline = time.monotonic() + within
        while True:
            for report in self.reports:
                if predicate(report):
                    return report
            if time.monotonic() >= deadline:
                raise TimeoutError("no matching report")
            await self._wait_report(deadline - time.monotonic())

    def status(self) -> worker_pb2.GetStatusResponse:
        """What GetStatus answers."""
        running = []
        for run in self.runs.values():
            item = worker_pb2.RunningTask(task_id=str(run.task.id), model_id=run.task.model_id, attempt=run.attempt, progress=run.percent)
            if run.task.started_at is not None:
                item.started_at.CopyFrom(timestamp(run.task.started_at))
            running.append(item)
        return worker_pb2.GetStatusResponse(
            worker_id=self.worker_id,
            device=self.device,
            models=self.models,
            slots=len(self.slots),
            free_slots=len(self._free_slots()),
            running=running,
            draining=self.draining,
        )
