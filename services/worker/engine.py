"""The worker engine: composes fetching, claiming, running, settling and the heartbeat; starts, drains, reports.

fetch.py takes a message when a slot is free, claim.py claims its task, run.py runs it and writes progress,
finish.py makes the final write, settle.py decides what happens next from the row, lease.py keeps the leases.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import time
from collections.abc import Coroutine
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from nats.aio.msg import Msg
from opentelemetry.trace import SpanKind

from services.worker import resume
from services.worker import runner as runmod
from services.worker.chatrun import ChatRunner
from services.worker.claim import Claimed, Claimer, Declined
from services.worker.consumer import Level
from services.worker.devices import Devices
from services.worker.fetch import Fetcher, SlotTicket
from services.worker.finish import Finisher, act
from services.worker.lease import Heartbeat
from services.worker.live import LiveProgress
from services.worker.retry import PermanentError, RetryableError
from services.worker.run import Attempts
from services.worker.runstate import Halt, Run
from services.worker.settle import Fate, Step
from services.worker.upstream import Upstream
from taskgate import results, runtime, telemetry, tracing
from taskgate.config import WorkerSettings
from taskgate.model import timestamp
from taskgate.runtime import Backends
from taskgate.signals import Signal
from taskgate.store import workers
from taskgate.wire import cancel, preempt
from taskgate_api.v1 import worker_pb2

log = logging.getLogger("taskgate.worker")


@dataclass(frozen=True, slots=True)
class RunReport:
    """What became of one message this worker took: a log line, and TestSignals.reported."""

    task_id: int
    outcome: Fate
    attempt: int = 0
    steps_done: int = 0
    total_steps: int = 0
    steps_at_abort: int | None = None
    error_code: str | None = None
    delay: float | None = None


@dataclass(frozen=True, slots=True)
class TestSignals:
    """What a worker signals to tests (taskgate.signals): disarmed in production, armed by a test before it starts."""

    __test__ = False  # not a pytest class
    reported: Signal[RunReport] = field(default_factory=Signal)  # every message handled, run or declined
    checkpointed: Signal[resume.Kept] = field(default_factory=Signal)  # every step checkpoint recorded

    def arm(self) -> TestSignals:
        self.reported.arm()
        self.checkpointed.arm()
        return self


def _seconds(a: datetime | None, b: datetime | None) -> float | None:
    return (b - a).total_seconds() if a is not None and b is not None else None


class Worker:
    """Consumes the dispatch messages of its models and runs them, one per free slot."""

    def __init__(
        self,
        settings: WorkerSettings,
        backends: Backends,
        runners: dict[tuple[str, str], runmod.ModelRunner | ChatRunner | Upstream],
        plan: runmod.DevicePlan,
        worker_id: str,
        models: list[str],
        signals: TestSignals | None = None,
    ) -> None:
        self.settings = settings
        self.signals = signals or TestSignals()
        self.pool = backends.pool
        self.bus = backends.bus
        self.worker_id = worker_id
        self.models = models
        self.device = ",".join(sorted(set(plan.devices)))
        self.plan = plan
        self.control_address: str | None = None  # host:port of WorkerControl, registered with the next beat
        self.devices = Devices(plan.devices)
        self._encoders = concurrent.futures.ThreadPoolExecutor(plan.slots, thread_name_prefix="encode")
        self.runs: dict[int, Run] = {}
        self.drain_requested = asyncio.Event()
        self.fetcher = Fetcher(
            bus=self.bus, settings=settings, worker_id=worker_id, models=models, slots=plan.slots, start=self._handle,
            spawn=self._spawn, changed=self._gauges, pools=plan.sequences,
        )
        self.claimer = Claimer(pool=self.pool, settings=settings, worker_id=worker_id)
        store = results.result_store(settings, self.bus)  # outputs go there, and image-to-video inputs come from it
        self.live = LiveProgress(self.bus)  # each step to the notifiers' streams, no row (the heartbeat writes one)
        self.attempts = Attempts(
            pool=self.pool, settings=settings, runners=runners, devices=self.devices, encoders=self._encoders,
            progressed=lambda: self.heartbeat.progressed(), inputs=store, bus=self.bus, stepped=self.live.stepped,
            kept=self.signals.checkpointed.signal,
        )
        self.finisher = Finisher(
            pool=self.pool, bus=self.bus, outputs=store, settings=settings, report=self._report_run,
        )
        self.heartbeat = Heartbeat(
            pool=self.pool,
            bus=self.bus,
            settings=settings,
            worker_id=worker_id,
            levels=self.fetcher.levels,
            runs=self.runs,
            registration=self._registration,
            check=self.attempts.check,
            gauges=self._gauges,
            use_cuda=plan.use_cuda,
        )
        self._tasks: set[asyncio.Task[Any]] = set()
        self._loops: list[asyncio.Task[None]] = []
        self._fetching: asyncio.Task[None] | None = None
        self._report_changed = asyncio.Event()
        self._drain_task: asyncio.Task[None] | None = None
        self._cancel_sub: Any = None
        self._preempt_sub: Any = None

    @property
    def draining(self) -> bool:
        """Whether this worker has stopped taking work."""
        return self.fetcher.draining

    def loops(self) -> list[asyncio.Task[None]]:
        """The loops that turn while this worker lives (its liveness): the heartbeat, and fetching until a drain."""
        return [loop for loop in self._loops if not (self.draining and loop is self._fetching)]

    # ---- life cycle ----

    async def start(self) -> None:
        """Registers, subscribes to cancel signals, and starts fetching and heartbeating."""
        await self.heartbeat.register()
        await self.fetcher.start()
        self._cancel_sub = await self.bus.nc.subscribe(cancel.SUBJECT, cb=self._on_cancel)
        self._preempt_sub = await self.bus.nc.subscribe(preempt.SUBJECT, cb=self._on_preempt)
        self._fetching = asyncio.create_task(self.fetcher.loop(), name="worker-dispatch")
        self._loops = [self._fetching, asyncio.create_task(self.heartbeat.loop(), name="worker-heartbeat"),
                       asyncio.create_task(self.live.loop(), name="worker-live-progress")]
        self._gauges()
        log.info(
            "worker started",
            extra={
                "worker": self.worker_id,
                "models": self.models,
                "slots": len(self.fetcher.slots),
                "device": self.device,
            },
        )

    def begin_drain(self, grace: float | None = None) -> asyncio.Task[None]:
        """Stops taking work; running tasks get `grace` seconds, then are released to other workers."""
        if self._drain_task is None:
            seconds = self.settings.drain_grace_seconds if grace is None else grace
            self._drain_task = asyncio.create_task(self._drain(seconds), name="worker-drain")
            self.drain_requested.set()
        return self._drain_task

    async def _drain(self, grace: float) -> None:
        self.fetcher.stop()
        log.info("draining", extra={"worker": self.worker_id, "running": len(self.runs), "grace_seconds": grace})
        with contextlib.suppress(Exception):
            await self.heartbeat.register()
        # a run that takes checkpoints loses nothing by stopping: it checkpoints at its next step and is released now
        for run in list(self.runs.values()):
            if self.attempts.checkpoints(run) is not None:
                run.stop(Halt.DRAIN)
        deadline = time.monotonic() + grace
        while self.runs and time.monotonic() < deadline:
            await self._wait_report(deadline - time.monotonic())
        for run in list(self.runs.values()):
            run.stop(Halt.DRAIN)
        # a stopped run releases its task at its next step; one that does not within drain_stop_seconds (a device
        # phase stuck in the driver, a backend that never answers) is abandoned as a crash would be: its lease expires
        stop_by = time.monotonic() + self.settings.drain_stop_seconds
        while self._tasks and (left := stop_by - time.monotonic()) > 0:
            await asyncio.wait(set(self._tasks), timeout=left)
        if self._tasks:
            log.error(
                "runs still stopping after the drain; abandoned",
                extra={"worker": self.worker_id, "tasks": len(self._tasks)},
            )
            await runtime.stop_tasks(list(self._tasks))

    async def close(self) -> None:
        """After a drain: stops the loops, unsubscribes, removes the registry row."""
        await self.begin_drain()
        await runtime.stop_tasks([*self._loops, *self.heartbeat.background()])
        await self.fetcher.close()
        self._close_threads()
        for model_runner in self.attempts.runners.values():
            if isinstance(model_runner, Upstream):
                await model_runner.close()  # its connections to the upstream server
        await self._unsubscribe()
        await self.claimer.close()
        with contextlib.suppress(Exception):
            await workers.unregister(self.pool, self.worker_id)
        self._gauges()
        log.info("worker stopped", extra={"worker": self.worker_id})

    async def kill(self) -> None:
        """A crash, for tests: stops everything at once and releases nothing (leases and messages just expire)."""
        self.fetcher.stop()
        for run in self.runs.values():
            run.stop(Halt.KILLED)
        await runtime.stop_tasks([*self._loops, *self._tasks, *self.heartbeat.background()])
        await self.claimer.abandon()
        await self.fetcher.close()
        self._close_threads()
        await self._unsubscribe()

    def _close_threads(self) -> None:
        self.devices.close()
        for model_runner in self.attempts.runners.values():
            if isinstance(model_runner, ChatRunner):
                model_runner.close()
        self._encoders.shutdown(wait=False, cancel_futures=True)

    async def _unsubscribe(self) -> None:
        for sub in (self._cancel_sub, self._preempt_sub):
            if sub is not None:
                with contextlib.suppress(Exception):
                    await sub.unsubscribe()

    def _spawn(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    # ---- one message ----

    async def _handle(self, ticket: SlotTicket, level: Level, msg: Msg) -> None:
        try:
            # a child of the dispatch that sent the message: a redelivery (after a retry, a release) is one more child
            with tracing.span(
                "worker dispatch",
                parent=msg.headers,
                kind=SpanKind.CONSUMER,
                attributes={
                    "messaging.system": "nats",
                    "messaging.destination.name": msg.subject,
                    "taskgate.worker": self.worker_id,
                },
            ):
                with tracing.span("claim"):
                    got = await self.claimer.claim(level, msg)
                task_id = got.task.id if isinstance(got, Claimed) else got.task_id
                if task_id is not None:
                    tracing.annotate({tracing.TASK_ID: str(task_id)})
                if isinstance(got, Claimed):
                    if got.task.run_alone:  # it lost a worker: nothing else is taken while it runs
                        self.fetcher.run_alone(ticket)
                    await self._run(ticket, msg, got)
                else:
                    await self._decline(level, msg, got)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("message handling failed", extra={"worker": self.worker_id})
        finally:
            self.fetcher.release(ticket)

    async def _decline(self, level: Level, msg: Msg, declined: Declined) -> None:
        step = declined.step
        if declined.alone:
            self.fetcher.drain_for(level)
        if step.fate is Fate.CAPPED and step.delay is not None:
            self.fetcher.cap(level.model_id, step.delay)
        await act(msg, step)
        if declined.task_id is not None and step.fate is not None:
            self._report(RunReport(declined.task_id, step.fate, delay=step.delay))

    async def _run(self, ticket: SlotTicket, msg: Msg, claimed: Claimed) -> None:
        task = claimed.task
        # Restart the ack wait now, so a redelivery after a crash comes after the lease has expired.
        await msg.in_progress()
        run = Run(task, msg, ticket)
        self.runs[task.id] = run
        self._gauges()
        wait = _seconds(task.queued_at or task.created_at, task.started_at)
        if wait is not None:
            telemetry.QUEUE_WAIT.labels(task.model_id).observe(max(0.0, wait))
        try:
            with tracing.span("attempt", attributes={tracing.TASK_ID: str(task.id), "taskgate.attempt": task.attempt}):
                if self.draining:
                    run.stop(Halt.DRAIN)
                    await self.finisher.stopped(run)
                elif claimed.reusable is not None:
                    await self.finisher.reused(run, claimed.reusable)
                else:
                    await self._perform(run)
        finally:
            self.runs.pop(task.id, None)
            self._gauges()
            self._notify()

    async def _perform(self, run: Run) -> None:
        try:
            output = await self.attempts.perform(run)
        except runmod.RunAborted:
            await self.finisher.stopped(run)
        except (RetryableError, PermanentError) as failure:
            await self.finisher.failed(run, failure)
        else:
            await self.finisher.succeeded(run, output)

    async def _on_cancel(self, msg: Msg) -> None:
        signal = cancel.decode(msg.data)
        run = self.runs.get(signal.task_id) if signal is not None else None
        if run is not None:
            self._spawn(self.attempts.check(run, "cancel signal"))

    async def _on_preempt(self, msg: Msg) -> None:
        task_id = preempt.decode(msg.data)
        run = self.runs.get(task_id) if task_id is not None else None
        # only a run that checkpoints (and so resumes where it stopped) is preempted; the others finish
        if run is not None and run.keeper is not None and not run.finishing:
            log.info("preempted", extra={"task_id": str(task_id), "attempt": run.attempt, "worker": self.worker_id})
            run.stop(Halt.PREEMPT)

    # ---- reporting ----

    def _registration(self) -> workers.Registration:
        return workers.Registration(
            self.worker_id, tuple(self.models), len(self.fetcher.slots), len(self.runs), self.device, self.draining,
            self.control_address, len(set(self.plan.devices)), self.plan.capacity,
        )

    def _gauges(self) -> None:
        telemetry.WORKER_RUNNING.set(len(self.runs))
        telemetry.WORKER_FREE_SLOTS.set(0 if self.draining else len(self.fetcher.free_slots()))

    def _report_run(self, run: Run, step: Step) -> None:
        assert step.fate is not None, "a settled run has a fate"
        self._report(
            RunReport(
                run.task.id,
                step.fate,
                run.attempt,
                run.steps_done,
                run.total_steps,
                run.steps_at_abort,
                step.error_code,
                step.delay,
            )
        )

    def _report(self, report: RunReport) -> None:
        tracing.annotate({"taskgate.outcome": report.outcome.value}, error=report.error_code)
        self.signals.reported.signal(report)
        log.info(
            "task handled",
            extra={
                "task_id": str(report.task_id),
                "outcome": report.outcome.value,
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

    def status(self) -> worker_pb2.GetStatusResponse:
        """What GetStatus answers."""
        running = []
        for run in self.runs.values():
            item = worker_pb2.RunningTask(
                task_id=str(run.task.id), model_id=run.task.model_id, attempt=run.attempt, progress=run.percent
            )
            if run.task.started_at is not None:
                item.started_at.CopyFrom(timestamp(run.task.started_at))
            running.append(item)
        return worker_pb2.GetStatusResponse(
            worker_id=self.worker_id,
            device=self.device,
            models=self.models,
            slots=len(self.fetcher.slots),
            free_slots=len(self.fetcher.free_slots()),
            running=running,
            draining=self.draining,
        )
