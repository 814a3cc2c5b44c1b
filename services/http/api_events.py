"""The TaskEvents routes of /v1 as Server-Sent Events (see services/http/api.py): one task's stream (its snapshot,
transitions and output chunks) and every task's, each opened before the response (a refusal is an HTTP error) and
resumed from the last id sent after an upstream drop."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
from sse_starlette import EventSourceResponse, ServerSentEvent
from starlette.requests import Request
from starlette.responses import Response

from taskgate.config import HttpSettings
from taskgate_api.v1 import events_pb2

from .inputs import BadInput, integer, status_value
from .upstream import Upstream, credentials, invalid, rpc_error_response, to_json

log = logging.getLogger("taskgate.http")

RESUMABLE = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.ABORTED, grpc.StatusCode.INTERNAL})
MAX_RESUMES = 20  # upstream drops in a row an SSE stream rides out (about 30 s of backoff) before it ends with an error


def event_id_of(version: int, sequence: int) -> str:
    """A WatchTask SSE id: the version, and the output sequence after a dot once output has been sent (`7`,
    `7.1042`), so one `Last-Event-ID` resumes both the events and the output."""
    return f"{version}.{sequence}" if sequence else str(version)


def event_id(value: str) -> tuple[int, int]:
    """The (version, output sequence) a WatchTask SSE id names; BadInput on `Last-Event-ID` otherwise."""
    version, dot, sequence = value.partition(".")
    if dot and not sequence:
        raise BadInput("Last-Event-ID", "a version, or a version and an output sequence joined by a dot")
    return integer(version, "Last-Event-ID"), integer(sequence, "Last-Event-ID") if dot else 0



class EventRoutes:
    """The TaskEvents routes; Api (api.py) is these plus the TaskGateway routes."""

    upstream: Upstream
    settings: HttpSettings
    closing: asyncio.Event

    async def task_events(self, request: Request) -> Response:
        """WatchTask as SSE: the snapshot (event `snapshot`), each transition (event `transition`) and the task's
        output chunks (event `output`, unless `?output=false`); id = `<version>` or `<version>.<output sequence>`."""
        task_id = request.path_params["task_id"]
        query = request.query_params
        header = request.headers.get("last-event-id")
        try:
            if header:
                last, sent = event_id(header)
            else:
                last = integer(query.get("after_version") or "0", "after_version")
                sent = integer(query.get("after_output_sequence") or "0", "after_output_sequence")
        except BadInput as exc:
            return invalid([(exc.field, f"must be an id this stream sent: {exc.description}")])
        wanted = (query.get("output") or "true").lower()
        if wanted not in ("true", "false", "1", "0"):
            return invalid([("output", "must be true or false")])
        include = wanted in ("true", "1")
        live = (query.get("progress") or "false").lower()
        if live not in ("true", "false", "1", "0"):
            return invalid([("progress", "must be true or false")])
        progress = live in ("true", "1")
        md = credentials(request)
        cursor = [last, sent]  # the version and the output sequence sent last: every id carries both

        def open_stream(since: tuple[int, int]) -> Any:
            watch = events_pb2.WatchTaskRequest(
                task_id=task_id, after_version=since[0], include_output=include, after_output_sequence=since[1]
            )
            return self.upstream.events.WatchTask(watch, metadata=md)

        def event_of(message: events_pb2.WatchTaskResponse) -> tuple[ServerSentEvent | None, tuple[int, int] | None]:
            kind = message.WhichOneof("kind")
            if kind == "snapshot":
                cursor[0] = message.snapshot.version
                data = json.dumps({"task": to_json(message.snapshot)})
            elif kind == "event":
                cursor[0] = message.event.version
                data = json.dumps(to_json(message.event))
            elif kind == "output":
                cursor[1] = message.output.sequence
                data = json.dumps(to_json(message.output))
            elif kind == "progress":  # live, not resumable: no id, so the client's Last-Event-ID stays where it was
                if not progress:
                    return None, None
                return ServerSentEvent(json.dumps(to_json(message.progress)), event="progress"), None
            else:
                return ServerSentEvent(comment="keep-alive"), None
            name = {"snapshot": "snapshot", "event": "transition", "output": "output"}[kind]
            return ServerSentEvent(data, event=name, id=event_id_of(cursor[0], cursor[1])), (cursor[0], cursor[1])

        return await self._sse(open_stream, event_of, (last, sent), request)

    async def all_events(self, request: Request) -> Response:
        """WatchTasks as SSE: every event of the caller's tasks (event `transition`), id = the cursor after it."""
        query = request.query_params
        cursor = request.headers.get("last-event-id") or query.get("cursor", "")
        statuses: list[int] = []
        for name in query.getlist("status"):
            for part in name.split(","):
                value = status_value(part)
                if value is None:
                    return invalid([("status", f"{part!r} is not a task status")])
                statuses.append(value)
        md = credentials(request)

        def open_stream(since: str) -> Any:
            return self.upstream.events.WatchTasks(
                events_pb2.WatchTasksRequest(statuses=statuses, cursor=since),  # type: ignore[arg-type]
                metadata=md,
            )

        def event_of(message: events_pb2.WatchTasksResponse) -> tuple[ServerSentEvent | None, str | None]:
            if message.WhichOneof("kind") == "event":
                return ServerSentEvent(
                    json.dumps(to_json(message.event)), event="transition", id=message.cursor
                ), message.cursor
            # a keep-alive moves the cursor too (past events of other states): resume from there
            return ServerSentEvent(comment="keep-alive"), message.cursor or None

        return await self._sse(open_stream, event_of, cursor, request)

    async def _sse(
        self,
        open_stream: Callable[[Any], Any],
        event_of: Callable[[Any], tuple[Any, Any]],
        resume: Any,
        request: Request,
    ) -> Response:
        """An SSE response over a gRPC stream that is opened first (so a refusal is an HTTP error, not an empty stream)
        and resumed from the last id after a drop."""
        call = open_stream(resume)
        stream = aiter(call)
        try:
            first = await anext(stream, None)
        except grpc.aio.AioRpcError as exc:
            return rpc_error_response(exc)
        state = {"resume": resume}

        async def events() -> AsyncIterator[ServerSentEvent]:
            nonlocal call, stream
            message = first
            drops = 0
            try:
                while not self.closing.is_set():
                    if message is None:
                        return  # the upstream stream ended: the task is terminal
                    event, position = event_of(message)
                    if position is not None:
                        state["resume"] = position
                    if event is not None:
                        yield event
                    while True:
                        try:
                            message = await anext(stream, None)
                            drops = 0
                            break
                        except grpc.aio.AioRpcError as exc:
                            if exc.code() not in RESUMABLE or drops >= MAX_RESUMES:
                                # the stream ends with the reason as its last event
                                yield ServerSentEvent(bytes(rpc_error_response(exc).body).decode(), event="error")
                                return
                            drops += 1
                            log.info("event stream resumed", extra={"code": exc.code().name, "drops": drops})
                            await asyncio.sleep(min(0.1 * 2**drops, 2.0))
                            call.cancel()
                            call = open_stream(state["resume"])
                            stream = aiter(call)
            finally:
                call.cancel()

        return EventSourceResponse(
            events(),
            ping=self.settings.stream_keepalive_seconds,
            headers={"cache-control": "no-store", "x-accel-buffering": "no"},
        )
