"""Following a server stream across drops: which ends are resumed, the pause before each resume, and the stream of
every task's events (WatchTasks) that resumes from its cursor."""

from __future__ import annotations

import asyncio
import contextlib
from collections import OrderedDict
from collections.abc import AsyncGenerator, Callable, Iterator
from typing import Protocol

import grpc

from taskgate_api.v1 import events_pb2
from taskgate_client.errors import TaskgateError, Unavailable, from_rpc_error
from taskgate_client.types import TaskEvent

# A stream that ends with one of these is resumed; the others are the caller's problem.
RESUMABLE = frozenset(
    {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.ABORTED, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED}
)
# watch_all() skips an event it already yielded (a resume may replay some); this many tasks are remembered.
TRACKED_TASKS = 10_000


async def pause_before_resume(
    error: TaskgateError | None, failures: int, limit: int, max_delay: float, ended: str
) -> None:
    """Before resuming a stream after its `failures`-th drop in a row: past `limit`, raises the last error (UNAVAILABLE
    with `ended` when the server just ended it); else waits the server's retry hint or the backoff, the longer."""
    if failures > limit:
        raise error or Unavailable(grpc.StatusCode.UNAVAILABLE, ended)
    hint = error.retry_delay if error is not None and error.retry_delay else 0.0
    await asyncio.sleep(max(hint, min(0.1 * 2 ** (failures - 1), max_delay)))


class Call(Protocol):
    """A server-streaming call, as far as following it needs."""

    def cancel(self) -> bool: ...


class Resumer:
    """The drops of one followed stream: each call's resumable end kept (`error`, None when the server just ended the
    call), any other end raised, and the pause before the next call, past `attempts` drops in a row the last error."""

    def __init__(self, attempts: int, max_delay: float, ended: str) -> None:
        self.error: TaskgateError | None = None
        self._failures = 0
        self._attempts = attempts
        self._max_delay = max_delay
        self._ended = ended

    def progressed(self) -> None:
        """The stream brought something new: the drops in a row start again from none."""
        self._failures = 0

    @contextlib.contextmanager
    def following(self, call: Call) -> Iterator[None]:
        """Around one call's iteration: a resumable error is kept in `error`, another raises as a TaskgateError; the
        call is cancelled when the block ends, however it ends."""
        self.error = None
        try:
            yield
        except grpc.aio.AioRpcError as exc:
            self.error = from_rpc_error(exc)
            if exc.code() not in RESUMABLE:
                raise self.error from None
        finally:
            call.cancel()

    async def pause(self) -> None:
        """Before the next call: one more drop in a row (see pause_before_resume)."""
        self._failures += 1
        await pause_before_resume(self.error, self._failures, self._attempts, self._max_delay, self._ended)


class AsyncEventStream:
    """WatchTasks as an async iterator of TaskEvent that resumes a dropped stream from its last cursor.

    `cursor` is where a later `watch_all(cursor=...)` resumes: save it after handling each event.
    """

    def __init__(
        self,
        open_stream: Callable[
            [str], grpc.aio.UnaryStreamCall[events_pb2.WatchTasksRequest, events_pb2.WatchTasksResponse]
        ],
        *,
        cursor: str,
        resume_attempts: int,
        max_delay: float,
    ) -> None:
        self.cursor = cursor
        self._open = open_stream
        self._resume_attempts = resume_attempts
        self._max_delay = max_delay
        self._events = self._follow()

    def __aiter__(self) -> AsyncEventStream:
        return self

    async def __anext__(self) -> TaskEvent:
        return await self._events.__anext__()

    async def aclose(self) -> None:
        """Ends the stream (leaving an `async for` early does not)."""
        await self._events.aclose()

    async def _follow(self) -> AsyncGenerator[TaskEvent, None]:
        seen: OrderedDict[str, int] = OrderedDict()
        resume = Resumer(self._resume_attempts, self._max_delay, "event stream keeps ending")
        while True:
            call = self._open(self.cursor)
            with resume.following(call):
                async for msg in call:
                    resume.progressed()
                    if msg.cursor:
                        self.cursor = msg.cursor
                    if msg.WhichOneof("kind") != "event" or seen.get(msg.event.task_id, 0) >= msg.event.version:
                        continue
                    seen[msg.event.task_id] = msg.event.version
                    seen.move_to_end(msg.event.task_id)
                    if len(seen) > TRACKED_TASKS:
                        seen.popitem(last=False)
                    yield TaskEvent.from_proto(msg.event)
            await resume.pause()
