"""An attempt's end: its final write (fenced by its attempt, retried through short outages), then settle's step."""

from __future__ import annotations

import dataclasses
import logging
import secrets
from collections.abc import Awaitable, Callable
from typing import TypeVar

import asyncpg
from nats.aio.msg import Msg

from services.worker import resume
from services.worker import runner as runmod
from services.worker.retry import PermanentError, RetryableError, persist
from services.worker.run import ACTOR
from services.worker.runstate import Halt, Run
from services.worker.settle import Fate, MessageAction, Produced, Released, Step, decide
from taskgate import bus as busmod
from taskgate import chat, results, store, tracing
from taskgate.config import WorkerSettings
from taskgate.store import ResultRef, workers
from taskgate.wire import dead_letter, preempt

log = logging.getLogger("taskgate.worker")

T = TypeVar("T")
Report = Callable[[Run, Step], None]


async def act(msg: Msg, step: Step) -> None:
    """Does what the step says with the message (keeping an output for reuse is the caller's part)."""
    if step.action is MessageAction.ACK:
        await msg.ack()
    elif step.action is MessageAction.NAK:
        await msg.nak(delay=step.delay)
    elif step.action is MessageAction.TERM:
        await msg.term()


def output_name(task_id: int, attempt: int, extension: str) -> str:
    """The object one run stores its output as: unique to the run, so a run fenced out that cleans up after itself can
    never delete what the run that replaced it stored (even one that somehow got the same attempt number)."""
    return f"{task_id}-a{attempt}-{secrets.token_hex(6)}.{extension}"


class Finisher:
    """Ends attempts: succeeded, reused, failed or stopped."""

    def __init__(
        self,
        *,
        pool: asyncpg.Pool,
        bus: busmod.Bus,
        outputs: results.ResultStore,
        settings: WorkerSettings,
        report: Report,
    ) -> None:
        self.pool = pool
        self.bus = bus
        self.outputs = outputs
        self.settings = settings
        self._report = report

    async def succeeded(self, run: Run, output: runmod.RunOutput) -> None:
        """Stores the output and records it as the task's result."""
        if run.stopped_by is Halt.KILLED:
            return
        await run.end_progress()
        task = run.task
        # kept in the row (no store's round trips), but for the s3 store, whose outputs carry a presigned URL
        if len(output.data) <= self.settings.result_inline_max_bytes and self.settings.result_store != "s3":
            stored = results.inline(output.data, output.content_type)
        else:
            name = output_name(task.id, task.attempt, output.extension)
            with tracing.span("store", attributes={"taskgate.result_bytes": len(output.data)}):
                stored = await self._persist(
                    "result", run, lambda: self.outputs.put(name, output.data, output.content_type)
                )
        await self._succeed(run, ResultRef(stored.uri, stored.content_type, stored.size, stored.sha256), output.text)

    async def reused(self, run: Run, result: ResultRef) -> None:
        """Records an earlier soft-cancelled run's output for the same request as the task's result (a chat task's
        answer read back from the store, to be inline as any other's; nothing was generated for it)."""
        await run.end_progress()
        text = None
        if run.task.task_type == chat.TASK_TYPE:
            data = await self._persist("reused answer", run, lambda: self._read(result.uri))
            answer = data.decode(errors="replace")
            text = store.TextOutcome(
                answer[: self.settings.result_inline_chars], len(answer), "stop",
                0, 0,  # nothing generated for it: nothing metered
            )
        await self._succeed(run, result, text)

    async def _read(self, uri: str) -> bytes:
        return b"".join([part async for part in self.outputs.read(uri)])

    async def failed(self, run: Run, failure: RetryableError | PermanentError) -> None:
        """Queues the task again after the failure's delay, or fails it (dead-lettered once its retries ran out)."""
        await run.end_progress()
        task = run.task
        if isinstance(failure, RetryableError):
            metered = run.metered(interrupted=True)  # once: a retried write must not count the waste twice
            out = await self._persist(
                "retry",
                run,
                lambda: store.retry(
                    self.pool,
                    task.id,
                    attempt=task.attempt,
                    error=failure.error,
                    delay_seconds=failure.delay,
                    actor=ACTOR,
                    reason=f"retry {failure.retry} of {task.max_retries}",
                    metered=metered,
                ),
            )
        else:
            out = await self._persist(
                "fail",
                run,
                lambda: store.fail(
                    self.pool, task.id, error=failure.error, actor=ACTOR, reason=failure.reason, attempt=task.attempt,
                    dead_letter=failure.dead_letter, metered=run.metered(),
                ),
            )
        await resume.forget(self.pool, self.outputs, out.task)
        step = decide(out.task, attempt=run.attempt, run=failure)
        if step.fate is Fate.DEAD and isinstance(failure, PermanentError):
            await dead_letter.publish(
                self.bus, task, reason=failure.reason, error_code=failure.code, error_message=failure.message
            )
        await self._settle(run, step)

    async def stopped(self, run: Run) -> None:
        """After a stop: a drained run releases its task; the others do what the row said when they were stopped."""
        reason = run.stopped_by
        assert reason is not None, "only a stopped run ends here"
        if reason is Halt.KILLED:
            return
        await run.end_progress()
        if reason in (Halt.DRAIN, Halt.PREEMPT):
            metered = run.metered(interrupted=True)
            preempted = reason is Halt.PREEMPT
            out = await self._persist(
                "release",
                run,
                lambda: store.release(
                    self.pool, run.task.id, actor=ACTOR, reason=preempt.REASON if preempted else "worker draining",
                    expected_attempt=run.attempt, metered=metered, keep_order=preempted,
                ),
            )
            reason = decide(out.task, attempt=run.attempt, run=Released())
            spec = self.settings.models.get(run.task.model_id)
            if preempted and reason.fate is Fate.RELEASED and spec is not None:
                # its message comes back after the task it made way for has had the slot
                reason = dataclasses.replace(reason, delay=spec.preempt_after_seconds)
        if reason.fate is Fate.LOST:
            log.warning("lease lost; output discarded", extra={"task_id": str(run.task.id), "attempt": run.attempt})
        await self._settle(run, reason)

    async def _succeed(self, run: Run, result: ResultRef, text: store.TextOutcome | None = None) -> None:
        task = run.task
        reason = "reused a soft-cancelled run's output" if result.reused else "finished"
        out = await self._persist(
            "succeed",
            run,
            lambda: store.succeed(
                self.pool,
                task.id,
                attempt=task.attempt,
                result=result,
                actor=ACTOR,
                reason=reason,
                metered=run.metered(),
                text=text,
            ),
        )
        await resume.forget(self.pool, self.outputs, out.task)
        produced = Produced(result.uri, reused=result.reused)
        step = decide(out.task, attempt=run.attempt, run=produced)
        if step.action is MessageAction.KEEP_REUSABLE:
            kept = await self._persist(
                "reusable", run, lambda: workers.keep_reusable(self.pool, task.id, attempt=task.attempt, result=result)
            )
            if kept:
                await self._let_go(run)
                await run.msg.ack()
                self._report(run, step)
                return
            step = decide(out.task, attempt=run.attempt, run=dataclasses.replace(produced, keepable=False))
        if not result.reused and step.fate is not Fate.SUCCEEDED:
            await self.outputs.delete(result.uri)
        if step.fate is Fate.FENCED:
            log.warning(
                "stale attempt's output discarded",
                extra={
                    "task_id": str(task.id),
                    "attempt": run.attempt,
                    "current_attempt": out.task.attempt if out.task else None,
                },
            )
        await self._settle(run, step)

    async def _settle(self, run: Run, step: Step) -> None:
        if step.fate is Fate.CANCELED:
            await self._let_go(run)
        await act(run.msg, step)
        self._report(run, step)

    async def _let_go(self, run: Run) -> None:
        """A cancelled attempt no longer runs here: its lease ends, and with it the tenant's pending slot it held."""
        try:
            await self._persist("let go", run, lambda: store.let_go(self.pool, run.task.id, attempt=run.attempt))
        except Exception:  # the lease lapses by itself; the scheduler then lets go for this worker
            log.warning("let go failed", extra={"task_id": str(run.task.id), "attempt": run.attempt}, exc_info=True)

    async def _persist(self, what: str, run: Run, action: Callable[[], Awaitable[T]]) -> T:
        return await persist(self.settings.lease_seconds, what, run.task.id, action)
