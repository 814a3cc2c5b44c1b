"""Natural batching without a timer: calls queue while a batch is in flight, and the next batch is all that queued
(taskgate.passes), each call awaiting its own item's result.

A lone call runs at once; under load each round trip carries every call that arrived during the previous one. The
submit service admits its tasks this way: one statement per batch, not per task.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import Generic, TypeVar

import grpc

from taskgate import errors
from taskgate.dispatcher import Dispatcher
from taskgate.passes import Passes
from taskgate.store import Conn, submissions
from taskgate.store.submissions import Admission, AdmitVerdict, Candidate

In = TypeVar("In")
Out = TypeVar("Out")

MAX_BATCH = 1000  # items per statement: one SubmitTasks call at most, or that many SubmitTask calls


class Batcher(Generic[In, Out]):
    """Runs `flush` over every item queued while the previous flush ran (at most `max_size` at a time).

    `flush` returns one result or exception per item, in order. Deadlines are each caller's own: a caller whose
    deadline has passed when its batch begins is left out of it (DEADLINE_EXCEEDED), a caller that gives up while its
    batch runs leaves the others' results alone, and no caller's deadline bounds the batch itself.
    """

    def __init__(self, flush: Callable[[list[In]], Awaitable[Sequence[Out | BaseException]]], *, max_size: int) -> None:
        self._flush = flush
        self._passes: Passes[tuple[In, asyncio.Future[Out], float | None]] = Passes(
            self._pass, max_batch=max_size, stopped=_cancel_waiting
        )

    async def run(self, items: Sequence[In], deadline: float | None) -> list[Out | BaseException]:
        """Each item's result or exception once the batches carrying them have run; DEADLINE_EXCEEDED (raised) when
        the loop time `deadline` (None: no deadline) passes first."""
        if not items:
            return []
        loop = asyncio.get_running_loop()
        futures: list[asyncio.Future[Out]] = [loop.create_future() for _ in items]
        self._passes.add(zip(items, futures, [deadline] * len(futures), strict=True))
        try:
            async with asyncio.timeout_at(deadline):
                results = await asyncio.gather(*futures, return_exceptions=True)
        except TimeoutError:
            raise deadline_exceeded(maybe_admitted=True) from None  # its batch may be running, or have committed
        for result in results:
            if isinstance(result, asyncio.CancelledError):  # the batcher itself was stopped
                raise result
        return results

    async def _pass(self, taken: list[tuple[In, asyncio.Future[Out], float | None]]) -> None:
        now = asyncio.get_running_loop().time()
        live = []
        for item, future, deadline in taken:
            if future.done():
                continue
            if deadline is not None and deadline <= now:  # its caller is out of time: it does not join
                future.set_exception(deadline_exceeded())
                continue
            live.append((item, future))
        if not live:
            return
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


def _cancel_waiting(left: list[tuple[In, asyncio.Future[Out], float | None]]) -> None:
    for _, future, _ in left:  # left only when the passes themselves were cancelled
        future.cancel()


NOT_ADMITTED = "the call's deadline passed before its submission joined a batch: this call admitted nothing; retry"
MAYBE_ADMITTED = (
    "the call's deadline passed while its submission was being admitted: it may have been admitted; "
    "retry with the same idempotency key"
)


def deadline_exceeded(*, maybe_admitted: bool = False) -> errors.ApiError:
    """DEADLINE_EXCEEDED saying only what is known: before a call joins a batch nothing of it was admitted; once its
    batch's statement runs, the commit may land after the caller left (a retry with the key finds the task)."""
    return errors.ApiError(grpc.StatusCode.DEADLINE_EXCEEDED, MAYBE_ADMITTED if maybe_admitted else NOT_ADMITTED)


class Submitter:
    """Admits submissions a batch at a time (one statement per batch) and hands each batch's created tasks to the
    dispatcher as soon as that statement has committed; the callers hear their answers without waiting for it."""

    def __init__(
        self, pool: Conn, dispatcher: Dispatcher, *, default_max_pending: int, db_timeout: float,
        history: submissions.History, end_users: submissions.EndUserLimits,
    ) -> None:
        self._pool = pool
        self._dispatcher = dispatcher
        self._default_max_pending = default_max_pending
        self._end_users = end_users
        self._db_timeout = db_timeout
        self._history = history
        self._admissions: Batcher[Candidate, Admission] = Batcher(self._admit, max_size=MAX_BATCH)

    async def admit(self, candidates: Sequence[Candidate], deadline: float | None) -> list[Admission | BaseException]:
        """Each submission's admission (or the backend error that stopped its batch), in order; raises
        DEADLINE_EXCEEDED when the loop time `deadline` (None: the call has none) passes first."""
        return await self._admissions.run(candidates, deadline)

    async def _admit(self, items: list[Candidate]) -> list[Admission]:
        admissions = await submissions.admit(
            self._pool, items, default_max_pending=self._default_max_pending, history=self._history,
            end_users=self._end_users, within=self._db_timeout
        )
        self._dispatcher.hand(a.task for a in admissions if a.verdict is AdmitVerdict.CREATED and a.task is not None)
        return admissions
