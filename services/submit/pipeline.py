"""SubmitStream: submissions pipelined over one long-lived stream, each answered by its request id.

A unary SubmitTask costs a call: an HTTP/2 stream opened and closed, headers both ways, a handler task, the
interceptor's work, the key's lookup. Over SubmitStream a request is one message each way; every request read is
admitted by the same path as SubmitTask (`Gateway._submit` of one), concurrently with the stream's other requests, so
requests that arrive together join the same batch of the Batcher (one statement). Each request is authenticated and
throttled as a call is (the key's cached principal, one token of the tenant's bucket), has its own deadline (its
`timeout`, else the stream's), and is answered with its task or its own error; the stream goes on.

The stream ends (OK) at its maximum age or when the server drains: it reads no more requests, answers those it read,
and closes, so the client opens another (on this or another server) for what it had not had read.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any, TypeAlias

import grpc

from taskgate import errors
from taskgate.server import as_api_error
from taskgate_api.v1 import gateway_pb2

Context: TypeAlias = "grpc.aio.ServicerContext[Any, Any]"
METHOD = "SubmitStream"
# requests of one stream being admitted at once: the stream reads no more until one is answered (HTTP/2 flow control
# then holds the client back)
MAX_IN_FLIGHT = 1000


class ItemContext:
    """One streamed request's side of a call context: the stream's metadata (its key), and a deadline that is the
    request's own or the stream's, whichever ends first."""

    __slots__ = ("_deadline", "_stream")

    def __init__(self, stream: Context, deadline: float | None) -> None:
        self._stream = stream
        self._deadline = deadline  # time.monotonic() by which the request must be answered; None: the stream's

    def invocation_metadata(self) -> Sequence[tuple[str, str | bytes]] | None:
        return self._stream.invocation_metadata()

    def time_remaining(self) -> float | None:
        theirs: float | None = self._stream.time_remaining()
        if self._deadline is None:
            return theirs
        mine = self._deadline - time.monotonic()
        return mine if theirs is None else min(mine, theirs)


def _deadline(msg: gateway_pb2.SubmitStreamRequest) -> float | None:
    """The time.monotonic() by which a request must be answered (None: the stream's deadline); a negative timeout is
    INVALID_ARGUMENT naming it."""
    if not msg.HasField("timeout"):
        return None
    seconds = msg.timeout.ToNanoseconds() / 1e9
    if seconds < 0:
        raise errors.invalid_argument([("timeout", "must not be negative")])
    return time.monotonic() + seconds


Submit = Callable[[gateway_pb2.SubmitStreamRequest, ItemContext], Awaitable[gateway_pb2.SubmitTaskResponse]]


async def serve(
    requests: AsyncIterator[gateway_pb2.SubmitStreamRequest],
    context: Context,
    submit: Submit,
    *,
    max_age: float,
    draining: asyncio.Event,
    max_in_flight: int = MAX_IN_FLIGHT,
) -> AsyncIterator[gateway_pb2.SubmitStreamResponse]:
    """The answers to `requests`, each as soon as its admission is done: its task, or its error status.

    Reading stops when the client half-closes, after `max_age` (90-100% of it) or when `draining` is set; the stream
    then ends once every request read was answered. A message that cannot be decoded ends the stream with its error
    after the others' answers (it has no request id to answer).
    """
    answers: asyncio.Queue[gateway_pb2.SubmitStreamResponse | None] = asyncio.Queue()
    slots = asyncio.Semaphore(max_in_flight)
    running: set[asyncio.Task[None]] = set()
    failed: list[BaseException] = []

    async def one(msg: gateway_pb2.SubmitStreamRequest) -> None:
        try:
            try:
                result = gateway_pb2.SubmitTaskResult(response=await submit(msg, ItemContext(context, _deadline(msg))))
            except Exception as exc:  # this request's refusal (or its backend's failure): the stream goes on
                result = gateway_pb2.SubmitTaskResult(error=as_api_error(exc, METHOD).status_proto)
            answers.put_nowait(gateway_pb2.SubmitStreamResponse(request_id=msg.request_id, result=result))
        finally:
            slots.release()

    async def read() -> None:
        try:
            while True:
                await slots.acquire()
                try:
                    msg = await anext(requests)
                except StopAsyncIteration:
                    slots.release()
                    return
                task = asyncio.create_task(one(msg))
                running.add(task)
                task.add_done_callback(running.discard)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # an undecodable message: the stream's end, after the answers owed
            failed.append(exc)

    async def finish(reader: asyncio.Task[None]) -> None:
        stop = asyncio.ensure_future(draining.wait())
        try:
            await asyncio.wait(
                (reader, stop), timeout=max_age * random.uniform(0.9, 1.0), return_when=asyncio.FIRST_COMPLETED
            )
        finally:
            stop.cancel()
            if not reader.done():  # its age, or the server drains: no more requests are read
                reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reader
        while running:
            await asyncio.gather(*running, return_exceptions=True)
        answers.put_nowait(None)

    reader = asyncio.create_task(read())
    finisher = asyncio.create_task(finish(reader))
    try:
        while (answer := await answers.get()) is not None:
            yield answer
        if failed:
            raise failed[0]
    finally:
        for task in (reader, finisher, *running):
            task.cancel()
