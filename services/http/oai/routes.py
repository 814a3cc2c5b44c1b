"""The routes of the OpenAI face (`/openai/v1`): Responses in background mode, Files and Batches, Models.

Each route is the gateway call the SDK would make, with the caller's `Authorization` header (a tenant API key as the
bearer token, or a client token where the gateway takes one) as its metadata; answers and errors are in OpenAI's
shapes (shapes.py, errors.py; a batch's lines: batchlines.py). A create without `background: true` is refused (400
on `background`): a response here is a task in a GPU queue of unknown length, and an HTTP request held open for it
would tie a connection (and the client's timeout) to the queue; a caller that wants to wait creates it in the
background and streams it.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
from sse_starlette import EventSourceResponse, ServerSentEvent
from starlette.datastructures import UploadFile
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import BaseRoute, Route

from taskgate.config import HttpSettings
from taskgate_api.v1 import batches_pb2, events_pb2, gateway_pb2, task_pb2

from ..inputs import BadInput, integer, json_body
from ..upstream import Upstream, credentials
from . import batchlines, errors, shapes
from .stream import Events

log = logging.getLogger("taskgate.http.openai")

PREFIX = "/openai/v1"
ENDPOINTS = ("/v1/responses", "/v1/chat/completions")
UPLOAD_PART = 1024 * 1024
_RESUMABLE = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.ABORTED, grpc.StatusCode.INTERNAL})
MAX_RESUMES = 20


class _Answer(Exception):
    """A finished answer raised from inside a handler."""

    def __init__(self, response: Response) -> None:
        super().__init__(response.status_code)
        self.response = response


def _answering(handler: Callable[[Any, Request], Awaitable[Response]]) -> Callable[[Any, Request], Awaitable[Response]]:
    """A route whose handler may raise _Answer, shapes.Refused or BadInput from anywhere inside it."""

    @functools.wraps(handler)
    async def route(face: Any, request: Request) -> Response:
        try:
            return await handler(face, request)
        except _Answer as answer:
            return answer.response
        except shapes.Refused as refused:
            return errors.error(refused.status, refused.message, param=refused.param, code=refused.code)
        except BadInput as bad:
            return errors.invalid(bad.field, bad.description)

    return route


def _listing(data: list[dict[str, Any]], has_more: bool) -> JSONResponse:
    return JSONResponse({
        "object": "list", "data": data, "first_id": data[0]["id"] if data else None,
        "last_id": data[-1]["id"] if data else None, "has_more": has_more,
    })


class Face:
    """The OpenAI face over one set of upstream channels."""

    def __init__(self, upstream: Upstream, settings: HttpSettings, closing: asyncio.Event) -> None:
        self.upstream = upstream
        self.settings = settings
        self.closing = closing
        self.body_cap = 2 * settings.grpc_max_message_bytes

    def routes(self) -> list[BaseRoute]:
        return [
            Route(f"{PREFIX}/models", self.models, methods=["GET"]),
            Route(f"{PREFIX}/models/{{model}}", self.model, methods=["GET"]),
            Route(f"{PREFIX}/responses", self.create_response, methods=["POST"]),
            Route(f"{PREFIX}/responses/{{response_id}}/cancel", self.cancel_response, methods=["POST"]),
            Route(f"{PREFIX}/responses/{{response_id}}", self.get_response, methods=["GET"]),
            Route(f"{PREFIX}/files", self.upload_file, methods=["POST"]),
            Route(f"{PREFIX}/files", self.list_files, methods=["GET"]),
            Route(f"{PREFIX}/files/{{file_id}}/content", self.file_content, methods=["GET"]),
            Route(f"{PREFIX}/files/{{file_id}}", self.get_file, methods=["GET"]),
            Route(f"{PREFIX}/batches", self.create_batch, methods=["POST"]),
            Route(f"{PREFIX}/batches", self.list_batches, methods=["GET"]),
            Route(f"{PREFIX}/batches/{{batch_id}}/cancel", self.cancel_batch, methods=["POST"]),
            Route(f"{PREFIX}/batches/{{batch_id}}", self.get_batch, methods=["GET"]),
            Route(f"{PREFIX}/{{rest:path}}", self.unknown, methods=["GET", "POST", "PUT", "PATCH", "DELETE"]),
        ]

    # -- plumbing ------------------------------------------------------------------------------------------------

    async def _call(self, make: Callable[[], Awaitable[Any]]) -> Any:
        try:
            return await make()
        except grpc.aio.AioRpcError as exc:
            raise _Answer(errors.from_rpc(exc)) from None

    @property
    def _timeout(self) -> float:
        return self.upstream.timeout

    async def _body(self, request: Request) -> dict[str, Any]:
        received = bytearray()
        try:
            async for chunk in request.stream():
                received += chunk
                if len(received) > self.body_cap:
                    raise _Answer(errors.invalid("body", f"larger than {self.body_cap} bytes"))
        except ClientDisconnect:
            raise _Answer(Response(status_code=499)) from None
        data = json_body(bytes(received), self.settings.http_json_max_depth)
        if not isinstance(data, dict):
            raise _Answer(errors.invalid("body", "must be a JSON object"))
        return data

    def _limit(self, request: Request) -> int:
        raw = request.query_params.get("limit")
        return 20 if raw is None else integer(raw, "limit", low=1, high=100)

    async def unknown(self, request: Request) -> Response:
        return errors.error(404, f"Invalid URL ({request.method} {request.url.path})", code="unknown_url")

    # -- models --------------------------------------------------------------------------------------------------

    async def _authenticated(self, request: Request) -> None:
        """Checks the caller's key with the gateway (the cheapest call that reads it)."""
        req = batches_pb2.ListFilesRequest(page_size=1)
        await self._call(
            lambda: self.upstream.gateway.ListFiles(req, metadata=credentials(request), timeout=self._timeout)
        )

    def _model_object(self, name: str) -> dict[str, Any]:
        return {"id": name, "object": "model", "created": 0, "owned_by": "taskgate"}

    @_answering
    async def models(self, request: Request) -> Response:
        await self._authenticated(request)
        return _listing([self._model_object(name) for name in sorted(self.settings.models)], False)

    @_answering
    async def model(self, request: Request) -> Response:
        await self._authenticated(request)
        name = request.path_params["model"]
        if name not in self.settings.models:
            return errors.error(404, f"The model '{name}' does not exist", param="model", code="model_not_found")
        return JSONResponse(self._model_object(name))

    # -- responses -----------------------------------------------------------------------------------------------

    @_answering
    async def create_response(self, request: Request) -> Response:
        body = await self._body(request)
        if body.get("store") is False:
            raise shapes.Refused("store", "a background response is stored: store must be true (or left out)")
        if body.get("background") is not True:
            raise shapes.Refused(
                "background",
                "this gateway runs responses in background mode only: pass background=true, then retrieve, poll or "
                "stream it (GET /responses/{id}?stream=true)", "background_required",
            )
        stream = body.get("stream")
        if stream is not None and not isinstance(stream, bool):
            raise shapes.Refused("stream", "must be a boolean")
        req = shapes.response_request(body, self.settings)
        req.idempotency_key = request.headers.get("idempotency-key", "")
        md = credentials(request)
        made = await self._call(lambda: self.upstream.gateway.SubmitTask(req, metadata=md, timeout=self._timeout))
        if stream:
            return await self._stream(request, made.task.id, -1)
        instructions = body.get("instructions") if isinstance(body.get("instructions"), str) else None
        return JSONResponse(shapes.response(made.task, instructions=instructions))

    async def _task(self, request: Request, text_id: str, prefix: str = shapes.RESPONSE_PREFIX) -> task_pb2.Task:
        """The chat task behind a response id (404 in OpenAI's shape for anything else)."""
        task_id = shapes.task_id_of(text_id, prefix)
        if task_id is None:
            raise _Answer(errors.not_found("response", text_id))
        req = gateway_pb2.GetTaskRequest(task_id=task_id)
        got = await self._call(
            lambda: self.upstream.gateway.GetTask(req, metadata=credentials(request), timeout=self._timeout)
        )
        if got.task.task_type != "chat":
            raise _Answer(errors.not_found("response", text_id))
        task: task_pb2.Task = got.task
        return task

    async def _full_text(self, request: Request, task: task_pb2.Task) -> str | None:
        """A SUCCEEDED task's whole answer: inline, or its result when the inline text was cut."""
        if task.status != task_pb2.TASK_STATUS_SUCCEEDED:
            return None
        if not task.text.truncated:
            return task.text.text
        got = bytearray()
        call = self.upstream.gateway.GetTaskResult(
            gateway_pb2.GetTaskResultRequest(task_id=task.id), metadata=credentials(request), timeout=self._timeout
        )
        try:
            async for chunk in call:
                got += chunk.data
        except grpc.aio.AioRpcError as exc:
            raise _Answer(errors.from_rpc(exc)) from None
        return got.decode(errors="replace")

    @_answering
    async def get_response(self, request: Request) -> Response:
        query = request.query_params
        response_id = request.path_params["response_id"]
        if query.get("stream", "false").lower() == "true":
            after = integer(query["starting_after"], "starting_after") if "starting_after" in query else -1
            task_id = shapes.task_id_of(response_id, shapes.RESPONSE_PREFIX)
            if task_id is None:
                return errors.not_found("response", response_id)
            await self._task(request, response_id)
            return await self._stream(request, task_id, after)
        task = await self._task(request, response_id)
        return JSONResponse(shapes.response(task, await self._full_text(request, task)))

    @_answering
    async def cancel_response(self, request: Request) -> Response:
        task = await self._task(request, request.path_params["response_id"])
        req = gateway_pb2.CancelTaskRequest(task_id=task.id, hard=True)
        got = await self._call(
            lambda: self.upstream.gateway.CancelTask(req, metadata=credentials(request), timeout=self._timeout)
        )
        return JSONResponse(shapes.response(got.task))

    async def _stream(self, request: Request, task_id: str, after: int) -> Response:
        """The response's events as SSE, from the task's history and output, after `after`."""
        md = credentials(request)

        def watch(after_output: int) -> Any:
            return self.upstream.events.WatchTask(events_pb2.WatchTaskRequest(
                task_id=task_id, include_output=True, after_output_sequence=after_output,
            ), metadata=md)

        call = watch(0)
        stream = aiter(call)
        try:
            first = await anext(stream, None)
        except grpc.aio.AioRpcError as exc:
            return errors.from_rpc(exc)
        if first is None or first.WhichOneof("kind") != "snapshot":
            call.cancel()
            return errors.error(503, "the task's stream ended before it began; retry", code="stream_unavailable")
        events = Events(task=first.snapshot, after=after)

        async def sse() -> AsyncIterator[ServerSentEvent]:
            nonlocal call, stream
            last_output = 0
            drops = 0
            message: events_pb2.WatchTaskResponse | None = first
            try:
                events.begin()
                while not self.closing.is_set():
                    if message is None:  # the upstream stream ended: the task is terminal
                        final = await self._task(request, shapes.response_id(task_id))
                        events.finish(final, await self._full_text(request, final))
                        for kind, body in events.take():
                            yield ServerSentEvent(json.dumps(body), event=kind)
                        return
                    what = message.WhichOneof("kind")
                    if what == "snapshot":
                        events.state(message.snapshot)
                    elif what == "event":
                        now = task_pb2.Task()
                        now.CopyFrom(events.task)
                        now.status = message.event.to_status
                        if message.event.to_status == task_pb2.TASK_STATUS_PROCESSING:
                            now.started_at.CopyFrom(message.event.at)
                        events.state(now)
                    elif what == "output":
                        last_output = max(last_output, message.output.sequence)
                        events.chunk(message.output)
                    for name, body in events.take():
                        yield ServerSentEvent(json.dumps(body), event=name)
                    while True:
                        try:
                            message = await anext(stream, None)
                            drops = 0
                            break
                        except grpc.aio.AioRpcError as exc:
                            if exc.code() not in _RESUMABLE or drops >= MAX_RESUMES:
                                body = json.loads(bytes(errors.from_rpc(exc).body))
                                yield ServerSentEvent(json.dumps({"type": "error", **body["error"]}), event="error")
                                return
                            drops += 1
                            await asyncio.sleep(min(0.1 * 2**drops, 2.0))
                            call.cancel()
                            call = watch(last_output)  # the output resumes after the last chunk placed
                            stream = aiter(call)
            except _Answer as answer:
                body = json.loads(bytes(answer.response.body))
                yield ServerSentEvent(json.dumps({"type": "error", **body.get("error", {})}), event="error")
            finally:
                call.cancel()

        return EventSourceResponse(
            sse(),
            ping=self.settings.stream_keepalive_seconds,
            headers={"cache-control": "no-store", "x-accel-buffering": "no"},
        )

    # -- files ---------------------------------------------------------------------------------------------------

    @_answering
    async def upload_file(self, request: Request) -> Response:
        try:
            form = await request.form(max_files=1, max_fields=4)
        except Exception as exc:  # starlette raises MultiPartException and others on a bad body
            raise _Answer(
                errors.invalid("file", f"a multipart/form-data body with `file` and `purpose`: {exc}")
            ) from None
        try:
            upload = form.get("file")
            purpose = form.get("purpose")
            if not isinstance(upload, UploadFile):
                raise shapes.Refused("file", "required: the JSONL file", "missing_required_parameter")
            if purpose != "batch":
                raise shapes.Refused("purpose", "only 'batch' files are taken here")

            async def parts() -> AsyncIterator[batches_pb2.UploadFileRequest]:
                yield batches_pb2.UploadFileRequest(filename=upload.filename or "input.jsonl", purpose="batch")
                while data := await upload.read(UPLOAD_PART):
                    yield batches_pb2.UploadFileRequest(data=data)

            stored = await self._call(
                lambda: self.upstream.gateway.UploadFile(parts(), metadata=credentials(request), timeout=self._timeout)
            )
        finally:
            await form.close()
        return JSONResponse(shapes.file_object(stored))

    @_answering
    async def get_file(self, request: Request) -> Response:
        req = batches_pb2.GetFileRequest(file_id=request.path_params["file_id"])
        got = await self._call(
            lambda: self.upstream.gateway.GetFile(req, metadata=credentials(request), timeout=self._timeout)
        )
        return JSONResponse(shapes.file_object(got))

    @_answering
    async def list_files(self, request: Request) -> Response:
        query = request.query_params
        req = batches_pb2.ListFilesRequest(
            purpose=query.get("purpose", ""), page_size=self._limit(request), after=query.get("after", ""),
        )
        got = await self._call(
            lambda: self.upstream.gateway.ListFiles(req, metadata=credentials(request), timeout=self._timeout)
        )
        return _listing([shapes.file_object(f) for f in got.files], got.has_more)

    async def _content(self, request: Request, file_id: str) -> tuple[batches_pb2.StoredFile, bytes]:
        got = bytearray()
        info = batches_pb2.StoredFile()
        call = self.upstream.gateway.GetFileContent(
            batches_pb2.GetFileRequest(file_id=file_id), metadata=credentials(request), timeout=self._timeout
        )
        try:
            async for chunk in call:
                if chunk.HasField("info"):
                    info = chunk.info
                got += chunk.data
        except grpc.aio.AioRpcError as exc:
            raise _Answer(errors.from_rpc(exc)) from None
        return info, bytes(got)

    @_answering
    async def file_content(self, request: Request) -> Response:
        info, data = await self._content(request, request.path_params["file_id"])
        if info.purpose in ("batch_output", "batch_error") and info.batch_id:
            req = batches_pb2.GetBatchRequest(batch_id=info.batch_id)
            batch = await self._call(
                lambda: self.upstream.gateway.GetBatch(req, metadata=credentials(request), timeout=self._timeout)
            )
            if batch.source_file_id:  # a batch of this face: its lines in OpenAI's shape
                lines = [
                    json.dumps(batchlines.result_line(json.loads(raw), batch.endpoint))
                    for raw in data.splitlines()
                    if raw.strip()
                ]
                data = ("\n".join(lines) + "\n").encode() if lines else b""
        return StreamingResponse(
            iter([data]), media_type="application/jsonl", headers={"content-length": str(len(data))}
        )

    # -- batches -------------------------------------------------------------------------------------------------

    @_answering
    async def create_batch(self, request: Request) -> Response:
        body = await self._body(request)
        for name in body:
            if name not in (
                "input_file_id",
                "endpoint",
                "completion_window",
                "metadata",
                "output_expires_after",
                "user",
            ):
                raise shapes.Refused(name, "is not supported by this gateway", "unsupported_parameter")
        endpoint = body.get("endpoint")
        if endpoint not in ENDPOINTS:
            raise shapes.Refused("endpoint", f"must be one of {', '.join(ENDPOINTS)}")
        window = body.get("completion_window")
        windows = self.settings.openai_windows
        if not isinstance(window, str) or window not in windows:
            raise shapes.Refused("completion_window", f"must be one of {', '.join(windows)}")
        seconds = windows[window]
        metadata = body.get("metadata") or {}
        if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
            raise shapes.Refused("metadata", "must be an object of string values")
        end_user = body.get("user") or ""
        if not isinstance(end_user, str):
            raise shapes.Refused("user", "must be a string")
        source = body.get("input_file_id")
        if not isinstance(source, str):
            raise shapes.Refused("input_file_id", "required", "missing_required_parameter")
        info, data = await self._content(request, source)
        if info.purpose != "batch":
            raise shapes.Refused("input_file_id", f"a file of purpose {info.purpose!r}, not 'batch'")
        translated = batchlines.translate_input(data, endpoint, seconds, self.settings)
        md = credentials(request)

        async def parts() -> AsyncIterator[batches_pb2.UploadFileRequest]:
            yield batches_pb2.UploadFileRequest(filename=f"{info.filename}.tasks.jsonl", purpose="batch")
            for start in range(0, len(translated), UPLOAD_PART):
                yield batches_pb2.UploadFileRequest(data=translated[start:start + UPLOAD_PART])

        tasks_file = await self._call(
            lambda: self.upstream.gateway.UploadFile(parts(), metadata=md, timeout=self._timeout)
        )
        req = batches_pb2.CreateBatchRequest(
            input_file_id=tasks_file.id, source_file_id=info.id, endpoint=endpoint, completion_window=window,
            window_seconds=seconds, metadata=metadata, end_user=end_user,
        )
        batch = await self._call(lambda: self.upstream.gateway.CreateBatch(req, metadata=md, timeout=self._timeout))
        return JSONResponse(shapes.batch_object(batch))

    @_answering
    async def get_batch(self, request: Request) -> Response:
        req = batches_pb2.GetBatchRequest(batch_id=request.path_params["batch_id"])
        got = await self._call(
            lambda: self.upstream.gateway.GetBatch(req, metadata=credentials(request), timeout=self._timeout)
        )
        return JSONResponse(shapes.batch_object(got))

    @_answering
    async def list_batches(self, request: Request) -> Response:
        req = batches_pb2.ListBatchesRequest(
            page_size=self._limit(request), after=request.query_params.get("after", "")
        )
        got = await self._call(
            lambda: self.upstream.gateway.ListBatches(req, metadata=credentials(request), timeout=self._timeout)
        )
        return _listing([shapes.batch_object(b) for b in got.batches], got.has_more)

    @_answering
    async def cancel_batch(self, request: Request) -> Response:
        req = batches_pb2.CancelBatchRequest(batch_id=request.path_params["batch_id"])
        got = await self._call(
            lambda: self.upstream.gateway.CancelBatch(req, metadata=credentials(request), timeout=self._timeout)
        )
        return JSONResponse(shapes.batch_object(got))
