"""One claimed attempt running here: the model in its slot's thread, its progress writes, and a look at its row."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import contextvars
import enum
import logging
import threading
import time
from dataclasses import dataclass, field

import asyncpg
from nats.aio.msg import Msg

from services.worker import retry, settle
from services.worker import runner as runmod
from services.worker.devices import Devices
from services.worker.fetch import SlotHold
from services.worker.settle import Action, Step
from taskgate import store, telemetry
from taskgate.config import Settings
from taskgate.model import TaskRow

log = logging.getLogger("taskgate.worker")

ACTOR = "worker"
PROGRESS_STEP = 10  # percent: a larger jump is written at once, a smaller one after progress_interval_seconds


class Halt(enum.Enum):
    """A stop that does not come from the task row."""

    DRAIN = "drain"  # this worker is shutting down: release the task, nak
    KILLED = "killed"  # a simulated crash: touch nothing


@dataclass(eq=False)
class Run:
    """One claimed attempt running here."""

    task: TaskRow
    msg: Msg
    hold: SlotHold
    abort: threading.Event = field(default_factory=threading.Event)
    stopped_by: Step | Halt | None = None
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

    @property
    def owns_message(self) -> bool:
        """False once the message is another attempt's (the task was taken over) or nobody's (a crash)."""
        stop = self.stopped_by
        return not (stop is Halt.KILLED or (isinstance(stop, Step) and stop.action is Action.NOTHING))

    def stop(self, reason: Step | Halt) -> None:
        """Asks the run to stop at its next step; the first reason wins."""
        if self.stopped_by is None:
            self.stopped_by = reason
            self.steps_at_abort = self.steps_done
        self.abort.set()

    async def end_progress(self) -> None:
        """Stops progress writes before a final transition, so none lands after it."""
        self.finishing = True
        if self.writer is not None and not self.writer.done():
            with contextlib.suppress(Exception):
                await self.writer


class Attempts:
    """Runs claimed attempts (the device phase on a device, then the CPU phase), writes their progress, and stops one
    whose row says it should."""

    def __init__(
        self,
        *,
        pool: asyncpg.Pool,
        settings: Settings,
        runners: dict[tuple[str, str], runmod.ModelRunner],
        devices: Devices,
        encoders: concurrent.futures.Executor,
    ) -> None:
        self.pool = pool
        self.settings = settings
        self.runners = runners
        self.devices = devices
        self.encoders = encoders

    async def perform(self, run: Run) -> runmod.RunOutput:
        """The run's output; raises RunAborted once it was stopped, RunError (classified) when it failed."""
        task = run.task
        inp = runmod.RunInput(task.id, task.attempt, task.prompt, dict(task.request_payload))
        loop = asyncio.get_running_loop()

        def on_step(step: int, total: int) -> None:
            loop.call_soon_threadsafe(self._on_step, run, step, total)

        # the threads run in a copy of this context: the phase spans they open are children of the attempt's
        try:
            async with self.devices.use({d for m, d in self.runners if m == task.model_id}) as lane:
                model_runner = self.runners[(task.model_id, lane.device)]
                rendered = await loop.run_in_executor(
                    lane.executor, contextvars.copy_context().run, model_runner.render, inp, on_step, run.abort.is_set
                )
            output = await loop.run_in_executor(self.encoders, contextvars.copy_context().run, model_runner.encode, rendered)
        except runmod.RunAborted:
            raise
        except Exception as exc:
            if run.stopped_by is not None:
                raise runmod.RunAborted(str(exc)) from exc
            failure = retry.classify(exc, task=task, settings=self.settings)
            log.warning(
                "run failed",
                extra={
                    "task_id": str(task.id),
                    "attempt": task.attempt,
                    "error_code": failure.code,
                    "retryable": isinstance(failure, retry.RetryableError) or failure.dead_letter,
                },
                exc_info=not isinstance(exc, runmod.InjectedFailure),
            )
            raise failure from exc
        telemetry.RUN_TIME.labels(task.model_id).observe(time.monotonic() - run.started)
        return output

    async def check(self, run: Run, why: str, row: TaskRow | None = None) -> None:
        """Reads the row (unless given) after a refused write or a cancel signal; stops the run if it is not ours to finish."""
        if run.finishing or run.stopped_by is not None:
            return
        if row is None:
            row = await store.get_task(self.pool, run.task.id)
        step = settle.decide(row, attempt=run.attempt, run=settle.Running())
        if step.fate is None:
            run.soft_canceled = run.soft_canceled or step.action is Action.KEEP_REUSABLE
            return
        if step.fate is settle.Fate.LOST:
            log.warning("lease lost", extra={"task_id": str(run.task.id), "attempt": run.attempt, "why": why})
        run.stop(step)

    def _on_step(self, run: Run, step: int, total: int) -> None:
        run.steps_done, run.total_steps = step, total
        if (run.writer is None or run.writer.done()) and self._progress_due(run):
            run.writer = asyncio.create_task(self._write_progress(run))

    def _progress_due(self, run: Run) -> bool:
        if run.finishing or run.soft_canceled or run.stopped_by is not None:
            return False
        if run.steps_done >= run.total_steps:
            return False  # the final transition writes 100 a moment later
        pct = run.percent
        if pct <= run.written:
            return False
        return pct - run.written >= PROGRESS_STEP or time.monotonic() - run.last_write >= self.settings.progress_interval_seconds

    async def _write_progress(self, run: Run) -> None:
        """Writes the newest progress while it is due; only the latest value is ever sent."""
        while self._progress_due(run):
            pct = run.percent
            run.written, run.last_write = pct, time.monotonic()
            try:
                out = await store.progress(
                    self.pool, run.task.id, attempt=run.attempt, percent=pct, lease_seconds=self.settings.lease_seconds, actor=ACTOR
                )
            except Exception:
                log.warning("progress write failed", extra={"task_id": str(run.task.id)}, exc_info=True)
                return
            if not out.applied:
                await self.check(run, "progress write refused", out.task)
                return
            # The write extended the lease; the ack wait must not end before it.
            await run.msg.in_progress()
