"""Submissions over one long-lived SubmitStream per channel: requests pipelined, answers matched by request id.

Many concurrent submit() calls then cost one message each way instead of a unary call each (an HTTP/2 stream opened and
closed, headers both ways, a handler on the server), and the gateway admits the requests that arrive together in one
statement. The stream is opened on first use and again after it ends; a request it ended without answering is sent
again on the next one (its idempotency key makes that safe). Every ROTATE_AFTER requests the stream is half-closed and
the next one (opened ahead) takes over: a stream is one call, which round_robin places on one server, so rotating keeps
the load spread over every server of the target as unary calls spread it (a stream per 8 requests is still 1/8 of a
call's cost per request). A server without SubmitStream (UNIMPLEMENTED), or one
whose stream places for the tenant are taken, is used by unary SubmitTask instead (`StreamUnavailable`), and the
stream is tried again after a while.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections.abc import AsyncIterator, Callable, Mapping

import grpc
from google.protobuf import duration_pb2
from google.rpc import status_pb2

from taskgate_api import _compat as compat
from taskgate_api import reasons
from taskgate_api.v1 import gateway_pb2
from taskgate_client.errors import from_rpc_error, from_status

# after UNIMPLEMENTED (or no stream place): unary SubmitTask for this long before the stream is tried again
RETRY_STREAM_SECONDS = 60.0
# streams that end without reading one request before it is answered UNAVAILABLE (and retried after a backoff)
UNANSWERED_LIMIT = 3
# requests one stream carries before the next goes on a new stream (this one half-closed, its answers still read): each
# stream is a call that round_robin places on the next server, so the load spreads over every address of the target
# (and reaches a server added later) as unary calls' does, for one stream opened per this many requests
ROTATE_AFTER = 8

Open = Callable[
    [AsyncIterator[gateway_pb2.SubmitStreamRequest]],
    "grpc.aio.StreamStreamCall[gateway_pb2.SubmitStreamRequest, gateway_pb2.SubmitStreamResponse]",
]


# a stream that ended with these lost only what it had not answered: sent again (UNAVAILABLE, with the SDK's backoff)
_BROKEN = frozenset({grpc.StatusCode.CANCELLED, grpc.StatusCode.INTERNAL, grpc.StatusCode.UNAVAILABLE})


class StreamUnavailable(Exception):
    """This server has no SubmitStream (or no stream place for us now): submit with SubmitTask."""


class _Unanswered(Exception):
    """The stream ended (OK) before the server read this request: send it again on a new stream."""


class _Stream:
    """One SubmitStream call: the requests it carries and their futures by request id."""

    def __init__(self, open_call: Open) -> None:
        self._outbox: asyncio.Queue[gateway_pb2.SubmitStreamRequest | None] = asyncio.Queue()
        self._pending: dict[int, asyncio.Future[gateway_pb2.SubmitTaskResponse]] = {}
        self._ids = itertools.count(1)
        self._answered = False  # whether any answer came: a stream refused at once is not a server's stream at all
        self.closed = False
        self.retired = False  # half-closed after ROTATE_AFTER requests: the next request opens a new stream
        self.sent = 0
        self.unsupported = False
        self._open = asyncio.Event()  # the server's headers came: it serves the stream
        self._call = open_call(self._requests())
        self._reader = asyncio.ensure_future(self._read())

    async def _requests(self) -> AsyncIterator[gateway_pb2.SubmitStreamRequest]:
        # nothing is written before the server accepted the stream: grpc reports a call that ends while requests are
        # being written as INTERNAL ("Internal error from Core"), which would hide UNIMPLEMENTED or UNAUTHENTICATED
        await self._open.wait()
        while (msg := await self._outbox.get()) is not None:
            yield msg

    async def send(
        self, request: gateway_pb2.SubmitTaskRequest, timeout: float | None, trace: Mapping[str, str]
    ) -> gateway_pb2.SubmitTaskResponse:
        rid = next(self._ids)
        future: asyncio.Future[gateway_pb2.SubmitTaskResponse] = asyncio.get_running_loop().create_future()
        self._pending[rid] = future
        msg = gateway_pb2.SubmitStreamRequest(request_id=rid, request=request, trace_context=trace)
        if timeout is not None:
            d = duration_pb2.Duration()
            d.FromNanoseconds(int(timeout * 1e9))
            msg.timeout.CopyFrom(d)
        self._outbox.put_nowait(msg)
        self.sent += 1
        if self.sent >= ROTATE_AFTER:
            self.retired = True
            self._outbox.put_nowait(None)  # done writing: the server answers what it read, then ends the call
        try:
            async with compat.timeout(timeout):
                return await future
        except TimeoutError:
            raise from_status(
                status_pb2.Status(
                    code=grpc.StatusCode.DEADLINE_EXCEEDED.value[0], message="no answer within the call's timeout"
                )
            ) from None
        finally:
            self._pending.pop(rid, None)

    async def _read(self) -> None:
        error: BaseException | None = None
        try:
            await self._call.initial_metadata()
            if not self._call.done():
                self._open.set()
            async for msg in self._call:
                self._answered = True
                future = self._pending.pop(msg.request_id, None)
                if future is None or future.done():
                    continue  # its caller gave up
                if msg.result.HasField("error"):
                    future.set_exception(from_status(msg.result.error))
                else:
                    future.set_result(msg.result.response)
            error = _Unanswered()
        except grpc.aio.AioRpcError as exc:
            refused = exc.code() is grpc.StatusCode.UNIMPLEMENTED or (
                not self._answered
                and exc.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
                and from_rpc_error(exc).reason == reasons.TOO_MANY_STREAMS
            )
            self.unsupported = refused
            if refused:
                error = StreamUnavailable()
            elif exc.code() in _BROKEN:  # the server went away, or ended while requests were written: retry them
                error = from_status(
                    status_pb2.Status(code=grpc.StatusCode.UNAVAILABLE.value[0], message=exc.details() or "")
                )
            else:
                error = from_rpc_error(exc)
        except asyncio.CancelledError:
            error = from_status(status_pb2.Status(code=grpc.StatusCode.CANCELLED.value[0], message="the client closed"))
            raise
        finally:
            self.closed = True
            self._outbox.put_nowait(None)
            for future in self._pending.values():
                if not future.done():
                    future.set_exception(error or _Unanswered())
            self._pending.clear()

    async def close(self) -> None:
        self.closed = True
        self._call.cancel()
        self._reader.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await self._reader


class SubmitPipe:
    """The submit streams of one channel: the current one, opened when needed."""

    def __init__(self, open_call: Open) -> None:
        self._open = open_call
        self._stream: _Stream | None = None
        self._next: _Stream | None = None  # opened ahead of the current one's rotation, so no request waits for it
        self._unary_until = 0.0

    async def submit(
        self, request: gateway_pb2.SubmitTaskRequest, timeout: float | None, trace: Mapping[str, str]
    ) -> gateway_pb2.SubmitTaskResponse:
        """The request's answer over the stream; its error as a TaskgateError; StreamUnavailable when SubmitTask
        must carry it instead."""
        for _ in range(UNANSWERED_LIMIT):
            if time.monotonic() < self._unary_until:
                raise StreamUnavailable
            stream = self._stream
            if stream is None or stream.closed or stream.retired:
                stream, self._next = self._next, None
                if stream is None or stream.closed:
                    stream = _Stream(self._open)
                self._stream = stream
            if stream.sent == ROTATE_AFTER // 2 and self._next is None:
                self._next = _Stream(self._open)
            try:
                return await stream.send(request, timeout, trace)
            except _Unanswered:
                continue  # the server ended that stream before reading it: the next stream carries it
            except StreamUnavailable:
                self._unary_until = time.monotonic() + RETRY_STREAM_SECONDS
                raise
        raise from_status(
            status_pb2.Status(
                code=grpc.StatusCode.UNAVAILABLE.value[0], message="the server kept ending its submit streams; retry"
            )
        )

    async def close(self) -> None:
        for stream in (self._stream, self._next):
            if stream is not None:
                await stream.close()
        self._stream = self._next = None
