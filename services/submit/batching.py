"""Natural batching without a timer: calls queue while a batch is in flight, and the next batch is all that queued.

A lone call runs at once; under load each round trip carries every call that arrived during the previous one. The
submit service admits, publishes and queues its tasks this way: one statement per batch, not per task.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

from taskgate import telemetry
from taskgate.bus import Bus
from taskgate.model import TaskRow
from taskgate.server import BACKEND_ERRORS
from taskgate.store import Conn, submissions
from taskgate.store.submissions import Admission, Candidate, Queued
from taskgate.wire import dispatch

log = logging.getLogger("taskgate.submit")

In = TypeVar("In")
Out = TypeVar("Out")

MAX_BATCH = 1000  # items per statement: one SubmitTasks call at most, or that many SubmitTask calls


class Batcher(Generic[In, Out]):
    """Runs `flush` over every item queued while the previous flush ran (at most `max_size` at a time).

    `flush` returns one result or exception per item, in order. A caller that gave up (cancelled) before its batch
    began is left out of it.
    """

    def __init__(self, flush: Callable[[list[In]], Awaitable[Sequence[Out | BaseException]]], *, max_size: int) -> None:
        self._flush = flush
        self._max_size = max_size
        self._queue: deque[tuple[In, asyncio.Future[Out]]] = deque()
        self._runner: asyncio.Task[None] | None = None

    async def run(self, items: Sequence[In]) -> list[Out | BaseException]:
        """Each item's result or exception, once the batches carrying them have run."""
        if not items:
            return []
        loop = asyncio.get_running_loop()
        futures: list[asyncio.Future[Out]] = []
        for item in items:
            future: asyncio.Future[Out] = loop.create_future()
            self._queue.append((item, future))
            futures.append(future)
        if self._runner is None:
            self._runner = asyncio.create_task(self._drain())
        results = await asyncio.gather(*futures, return_exceptions=True)
        for result in results:
            if isinstance(result, asyncio.CancelledError):  # the batcher itself was stopped
                raise result
        return results

    async def _drain(self) -> None:
        try:
            while self._queue:
                taken = [self._queue.popleft() for _ in range(min(self._max_size, len(self._queue)))]
                live = [(item, future) for item, future in taken if not future.done()]
                if not live:
                    continue
                try:
                    results: Sequence[Out | BaseException] = await self._flush([item for item, _ in live])
                except asyncio.CancelledError:
                    for _, future in live:
                        future.cancel()
                    raise
                except Exception as exc:  # the whole batch failed: each caller hears why
                    results = [exc] * len(live)
                for (_, future), result in zip(live, results, strict=True):
                    if future.done():
                        continue
                    if isinstance(result, BaseException):
                        future.set_exception(result)
                    else:
                        future.set_result(result)
        finally:
            self._runner = None
            for _, future in self._queue:  # left only when the runner itself was cancelled
                future.cancel()
            self._queue.clear()


@dataclass(frozen=True, slots=True)
class ToAdmit:
    """A submission to admit and the loop time by which its statement must be done."""

    candidate: Candidate
    deadline: float


@dataclass(frozen=True, slots=True)
class ToDispatch:
    """A created task to publish and queue, with the loop times by which its publish and its move must be done."""

    task: TaskRow
    publish_deadline: float
    deadline: float


def _within(deadlines: Sequence[float]) -> float:
    """Seconds a batch's statement may take: until the earliest deadline among its callers."""
    return max(min(deadlines) - asyncio.get_running_loop().time(), 0.001)


class Submitter:
    """Admits submissions and dispatches the created tasks a batch at a time: one admission statement, pipelined
    JetStream publishes, and one QUEUED move per batch."""

    def __init__(self, pool: Conn, bus: Bus, *, default_max_pending: int, actor: str) -> None:
        self._pool = pool
        self._bus = bus
        self._default_max_pending = default_max_pending
        self._actor = actor
        self._admissions: Batcher[ToAdmit, Admission] = Batcher(self._admit, max_size=MAX_BATCH)
        self._dispatches: Batcher[ToDispatch, Queued] = Batcher(self._dispatch, max_size=MAX_BATCH)

    async def admit(self, items: Sequence[ToAdmit]) -> list[Admission | BaseException]:
        """Each submission's admission (or the backend error that stopped its batch), in order."""
        return await self._admissions.run(items)

    async def dispatch(self, items: Sequence[ToDispatch]) -> list[Queued | BaseException]:
        """Each task after publishing and queueing: QUEUED with its position, or as it truly is when either failed."""
        return await self._dispatches.run(items)

    async def _admit(self, items: list[ToAdmit]) -> list[Admission]:
        return await submissions.admit(
            self._pool,
            [i.candidate for i in items],
            default_max_pending=self._default_max_pending,
            within=_within([i.deadline for i in items]),
        )

    async def _dispatch(self, items: list[ToDispatch]) -> list[Queued]:
        """Publish all (acks pipelined), then one QUEUED move for those acknowledged; a task whose publish or move
        failed stays CREATED, safe: the scheduler re-publishes it with the same message id."""
        published = await dispatch.publish_many(
            self._bus,
            [(i.task, dispatch.Reason.SUBMITTED) for i in items],
            ack_timeout=_within([i.publish_deadline for i in items]),
        )
        failed = len(items) - len(published)
        if failed:
            telemetry.SUBMIT_PUBLISH_FAILURES.inc(failed)
        acked = {task.id for task, _ in published}
        to_queue = [i.task for i in items if i.task.id in acked]
        queued: dict[int, Queued] = {}
        if to_queue:
            try:
                moved = await submissions.queue_many(
                    self._pool, to_queue, actor=self._actor, reason="dispatched",
                    within=_within([i.deadline for i in items if i.task.id in acked]),
                )
                queued = {q.task.id: q for q in moved}
            except BACKEND_ERRORS as exc:
                log.warning("queue move failed; tasks stay CREATED", extra={"tasks": len(to_queue), "error": type(exc).__name__})
        return [queued.get(i.task.id, Queued(i.task, 0)) for i in items]
