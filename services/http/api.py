"""The TaskGateway and TaskEvents API as JSON over HTTP, with Server-Sent Events for the streams.

Each route is the gRPC call the SDK would make: the same keys (`Authorization: Bearer`), the same rules and limits
(the gRPC services apply them), the answers in the proto3 JSON mapping with the .proto's field names. Streams are
`text/event-stream`, one event per version (`id:` the version, or the WatchTasks cursor) and, on a task's stream, one
per output chunk (`id:` the version and the output sequence, `7.1042`), resumable with `Last-Event-ID`, kept alive with
comments; a dropped upstream stream (a notifier restart) is resumed from the last id sent, so the client sees no gap and
no repeat.
"""

from __future__ import annotations

import asyncio
import base64
import functools
import json
import re
from collections.abc import AsyncIterator, Awaitable, Callable
from datetime import datetime
from typing import Any

import grpc
from google.protobuf import json_format
from google.protobuf.message import Message
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, RedirectResponse, Response, StreamingResponse
from starlette.routing import BaseRoute, Route

from taskgate.config import HttpSettings
from taskgate_api.v1 import gateway_pb2

from .api_events import EventRoutes
from .inputs import BadInput, integer, json_body, status_value
from .upstream import Upstream, credentials, error_response, invalid, rpc_error_response, status_code_of, to_json

POLL_HEADER = "x-suggested-poll-interval"  # seconds until the next GET is worth making
UPLOAD_PART = 1024 * 1024
_RANGE = re.compile(r"^bytes=([0-9]*)-([0-9]*)$")


class BodyTooLarge(Exception):
    """A request body over its cap."""


async def _body(request: Request, cap: int) -> bytes:
    """The request body, refused once past `cap` bytes (nothing larger is held in memory)."""
    received = bytearray()
    async for chunk in request.stream():
        received += chunk
        if len(received) > cap:
            raise BodyTooLarge
    return bytes(received)


def _when(value: str) -> datetime | None:
    try:
        moment = datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        return None
    return moment if moment.tzinfo is not None else None


class _Answer(Exception):
    """A finished HTTP answer raised from deep inside a handler (an upstream error, a bad body)."""

    def __init__(self, response: Response) -> None:
        super().__init__(response.status_code)
        self.response = response


def _answering(handler: Callable[[Any, Request], Awaitable[Response]]) -> Callable[[Any, Request], Awaitable[Response]]:
    """A route whose handler may raise _Answer (an upstream error, a bad body) from anywhere inside it."""

    @functools.wraps(handler)
    async def route(api: Any, request: Request) -> Response:
        try:
            return await handler(api, request)
        except _Answer as answer:
            return answer.response

    return route


class Api(EventRoutes):
    """The routes of /v1 over one set of upstream channels (the TaskEvents ones are EventRoutes', in api_events.py)."""

    def __init__(self, upstream: Upstream, settings: HttpSettings, closing: asyncio.Event) -> None:
        self.upstream = upstream
        self.settings = settings
        self.closing = closing
        self.body_cap = 2 * settings.grpc_max_message_bytes  # JSON with a base64 image is 4/3 of the message

    def routes(self) -> list[BaseRoute]:
        return [
            Route("/v1/tasks:batch", self.submit_batch, methods=["POST"]),
            Route("/v1/tasks", self.submit, methods=["POST"]),
            Route("/v1/tasks", self.list_tasks, methods=["GET"]),
            Route("/v1/tasks/{task_id}:cancel", self.cancel, methods=["POST"]),
            Route("/v1/tasks/{task_id}:regenerate", self.regenerate, methods=["POST"]),
            Route("/v1/tasks/{task_id}/result", self.result, methods=["GET"]),
            Route("/v1/tasks/{task_id}/previews", self.preview, methods=["GET"]),
            Route("/v1/tasks/{task_id}/events", self.task_events, methods=["GET"]),
            Route("/v1/tasks/{task_id}", self.get_task, methods=["GET"]),
            Route("/v1/events", self.all_events, methods=["GET"]),
            Route("/v1/inputs", self.upload, methods=["PUT", "POST"]),
            Route("/v1/webhook-secret:rotate", self.rotate_webhook_secret, methods=["POST"]),
            Route("/v1/client-tokens", self.create_client_token, methods=["POST"]),
            Route("/v1/client-token-secret", self.client_token_secret, methods=["POST"]),
        ]

    # -- plumbing ------------------------------------------------------------------------------------------------

    async def _call(self, make: Callable[[], Awaitable[Any]]) -> Any:
        """One unary call; a gRPC error becomes its HTTP answer (raised as _Answer)."""
        try:
            return await make()
        except grpc.aio.AioRpcError as exc:
            raise _Answer(rpc_error_response(exc)) from None

    async def _json(self, request: Request, message: Message, *, optional: bool = False) -> Message:
        """The body parsed into `message` (proto3 JSON); 400 naming the body when it is not that or is past the cap."""
        try:
            raw = await _body(request, self.body_cap)
        except BodyTooLarge:
            raise _Answer(invalid([("body", f"larger than {self.body_cap} bytes")])) from None
        except ClientDisconnect:
            raise _Answer(Response(status_code=499)) from None
        if not raw.strip() and optional:
            return message
        try:
            data = json_body(raw, self.settings.http_json_max_depth)
            if not isinstance(data, dict):
                raise ValueError("must be a JSON object")
            json_format.ParseDict(data, message)
        except (ValueError, RecursionError, json_format.ParseError) as exc:
            raise _Answer(invalid([("body", str(exc) or "not valid JSON")])) from None
        return message

    def _idempotency(self, request: Request, body_key: str) -> str:
        header = request.headers.get("idempotency-key")
        if header is None:
            return body_key
        if body_key and body_key != header:
            raise _Answer(invalid([("Idempotency-Key", "differs from the body's idempotency_key: send one")]))
        return header

    @property
    def _timeout(self) -> float:
        return self.upstream.timeout

    # -- TaskGateway ---------------------------------------------------------------------------------------------

    @_answering
    async def submit(self, request: Request) -> Response:
        req = await self._json(request, gateway_pb2.SubmitTaskRequest())
        assert isinstance(req, gateway_pb2.SubmitTaskRequest)
        req.idempotency_key = self._idempotency(request, req.idempotency_key)
        resp = await self._call(
            lambda: self.upstream.gateway.SubmitTask(req, metadata=credentials(request), timeout=self._timeout)
        )
        headers = {"location": f"/v1/tasks/{resp.task.id}"}
        return JSONResponse(
            to_json(resp) | {"created": resp.created}, status_code=201 if resp.created else 200, headers=headers
        )

    @_answering
    async def submit_batch(self, request: Request) -> Response:
        req = await self._json(request, gateway_pb2.SubmitTasksRequest())
        assert isinstance(req, gateway_pb2.SubmitTasksRequest)
        resp = await self._call(
            lambda: self.upstream.gateway.SubmitTasks(req, metadata=credentials(request), timeout=self._timeout)
        )
        results: list[dict[str, Any]] = []
        for item in resp.results:
            if item.HasField("error"):
                code = status_code_of(item.error.code)
                answer = json.loads(bytes(error_response(code, item.error.message, item.error).body))
                results.append(answer)
            else:
                results.append({"response": to_json(item.response) | {"created": item.response.created}})
        return JSONResponse({"results": results})

    @_answering
    async def get_task(self, request: Request) -> Response:
        req = gateway_pb2.GetTaskRequest(task_id=request.path_params["task_id"])
        resp = await self._call(
            lambda: self.upstream.gateway.GetTask(req, metadata=credentials(request), timeout=self._timeout)
        )
        seconds = resp.suggested_poll_interval.ToTimedelta().total_seconds()
        headers = {POLL_HEADER: f"{seconds:g}", "cache-control": "no-store"}
        return JSONResponse(to_json(resp), headers=headers)

    @_answering
    async def list_tasks(self, request: Request) -> Response:
        query = request.query_params
        req = gateway_pb2.ListTasksRequest(page_token=query.get("page_token", ""))
        bad: list[tuple[str, str]] = []
        for name in query.getlist("status"):
            for part in name.split(","):
                value = status_value(part)
                if value is None:
                    bad.append(("status", f"{part!r} is not a task status"))
                else:
                    req.statuses.append(value)  # type: ignore[arg-type]
        if "page_size" in query:
            try:
                req.page_size = integer(query["page_size"], "page_size", high=2**31 - 1)
            except BadInput as exc:
                bad.append((exc.field, exc.description))
        for name in ("created_after", "created_before"):
            if name in query:
                moment = _when(query[name])
                if moment is None:
                    bad.append((name, "must be an RFC 3339 time with its offset, e.g. 2026-12-01T10:00:00Z"))
                else:
                    try:
                        getattr(req, name).FromDatetime(moment)
                    except (ValueError, OverflowError):
                        bad.append((name, "out of range"))
        if bad:
            return invalid(bad)
        resp = await self._call(
            lambda: self.upstream.gateway.ListTasks(req, metadata=credentials(request), timeout=self._timeout)
        )
        return JSONResponse({"tasks": [to_json(t) for t in resp.tasks], "next_page_token": resp.next_page_token})

    @_answering
    async def cancel(self, request: Request) -> Response:
        req = await self._json(request, gateway_pb2.CancelTaskRequest(), optional=True)
        assert isinstance(req, gateway_pb2.CancelTaskRequest)
        req.task_id = request.path_params["task_id"]
        resp = await self._call(
            lambda: self.upstream.gateway.CancelTask(req, metadata=credentials(request), timeout=self._timeout)
        )
        return JSONResponse(to_json(resp))

    @_answering
    async def regenerate(self, request: Request) -> Response:
        req = await self._json(request, gateway_pb2.RegenerateTaskRequest(), optional=True)
        assert isinstance(req, gateway_pb2.RegenerateTaskRequest)
        req.task_id = request.path_params["task_id"]
        req.idempotency_key = self._idempotency(request, req.idempotency_key)
        resp = await self._call(
            lambda: self.upstream.gateway.RegenerateTask(req, metadata=credentials(request), timeout=self._timeout)
        )
        return JSONResponse(to_json(resp) | {"created": resp.created}, status_code=201 if resp.created else 200)

    @_answering
    async def rotate_webhook_secret(self, request: Request) -> Response:
        """A new webhook secret for the caller's own tenant (shown once: never cached); body `{"overlap": "3600s"}`
        optional."""
        req = await self._json(request, gateway_pb2.TaskGatewayRotateWebhookSecretRequest(), optional=True)
        assert isinstance(req, gateway_pb2.TaskGatewayRotateWebhookSecretRequest)
        resp = await self._call(
            lambda: self.upstream.gateway.RotateWebhookSecret(req, metadata=credentials(request), timeout=self._timeout)
        )
        return JSONResponse(to_json(resp), headers={"cache-control": "no-store"})

    @_answering
    async def create_client_token(self, request: Request) -> Response:
        """A short-lived token for one end user's tasks (API key only): body `{"end_user": "u-17", "scopes": ["read",
        "watch"], "task_ids": [...], "ttl": "900s"}`, all optional."""
        req = await self._json(request, gateway_pb2.CreateClientTokenRequest(), optional=True)
        assert isinstance(req, gateway_pb2.CreateClientTokenRequest)
        resp = await self._call(
            lambda: self.upstream.gateway.CreateClientToken(req, metadata=credentials(request), timeout=self._timeout)
        )
        return JSONResponse(to_json(resp), headers={"cache-control": "no-store"})

    @_answering
    async def client_token_secret(self, request: Request) -> Response:
        """The tenant's client-token secret for minting offline (API key only); body `{"rotate": true, "overlap":
        "3600s"}` for a new one."""
        req = await self._json(request, gateway_pb2.GetClientTokenSecretRequest(), optional=True)
        assert isinstance(req, gateway_pb2.GetClientTokenSecretRequest)
        resp = await self._call(
            lambda: self.upstream.gateway.GetClientTokenSecret(
                req, metadata=credentials(request), timeout=self._timeout
            )
        )
        return JSONResponse(to_json(resp), headers={"cache-control": "no-store"})

    @_answering
    async def preview(self, request: Request) -> Response:
        """One preview image of a task: `?uri=` an OUTPUT_KIND_PREVIEW chunk's uri (GetTaskResult with preview_uri)."""
        uri = request.query_params.get("uri") or ""
        if not uri:
            return invalid([("uri", "is required: the uri of one of the task's preview output chunks")])
        req = gateway_pb2.GetTaskResultRequest(task_id=request.path_params["task_id"], preview_uri=uri)
        data = bytearray()
        info = None
        try:
            async for chunk in self.upstream.gateway.GetTaskResult(
                req, metadata=credentials(request), timeout=self._timeout
            ):
                if chunk.HasField("info"):
                    info = chunk.info
                data += chunk.data
        except grpc.aio.AioRpcError as exc:
            return rpc_error_response(exc)
        # a preview never changes: its name says task, attempt, step
        headers = {"cache-control": "private, max-age=3600"}
        if info is not None and info.sha256:
            headers["etag"] = f'"{info.sha256}"'
        media = info.content_type if info is not None and info.content_type else "application/octet-stream"
        return Response(bytes(data), media_type=media, headers=headers)

    @_answering
    async def result(self, request: Request) -> Response:
        """The output: a redirect to its download URL when the store gives one, else its bytes (Range honoured)."""
        task_id = request.path_params["task_id"]
        md = credentials(request)
        got = await self._call(
            lambda: self.upstream.gateway.GetTask(
                gateway_pb2.GetTaskRequest(task_id=task_id), metadata=md, timeout=self._timeout
            )
        )
        if got.task.result.url:
            return RedirectResponse(got.task.result.url, status_code=307)
        call = self.upstream.gateway.GetTaskResult(
            gateway_pb2.GetTaskResultRequest(task_id=task_id), metadata=md, timeout=self._timeout
        )
        stream = aiter(call)
        try:
            first: gateway_pb2.ResultChunk = await anext(stream)
        except grpc.aio.AioRpcError as exc:
            return rpc_error_response(exc)
        info = first.info
        size = info.size_bytes
        start, end = 0, size - 1
        status = 200
        headers = {
            "content-type": info.content_type or "application/octet-stream",
            "accept-ranges": "bytes",
            "etag": f'"{info.sha256}"',
            "cache-control": "private, max-age=3600",
        }
        if info.sha256:
            digest = base64.b64encode(bytes.fromhex(info.sha256)).decode()
            headers["digest"] = f"sha-256={digest}"  # RFC 3230, what curl and most clients know
            headers["repr-digest"] = f"sha-256=:{digest}:"  # RFC 9530
        wanted = request.headers.get("range")
        if wanted:
            match = _RANGE.match(wanted.strip())
            first_byte, last_byte = (match.group(1), match.group(2)) if match else ("", "")
            if match is None or (not first_byte and not last_byte):
                call.cancel()
                return Response(status_code=416, headers={"content-range": f"bytes */{size}"})
            try:
                if first_byte:
                    start = integer(first_byte, "Range")
                    end = min(integer(last_byte, "Range"), size - 1) if last_byte else size - 1
                else:  # the last N bytes
                    start, end = max(size - integer(last_byte, "Range"), 0), size - 1
            except BadInput:
                start, end = 1, 0  # past any int64 offset: unsatisfiable
            if start > end or start >= size:
                call.cancel()
                return Response(status_code=416, headers={"content-range": f"bytes */{size}"})
            status = 206
            headers["content-range"] = f"bytes {start}-{end}/{size}"
        headers["content-length"] = str(end - start + 1 if size else 0)

        async def body() -> AsyncIterator[bytes]:
            offset = 0
            chunk: gateway_pb2.ResultChunk | None = first
            try:
                while chunk is not None:
                    data = chunk.data
                    lo, hi = max(start - offset, 0), min(end + 1 - offset, len(data))
                    if lo < hi:
                        yield data[lo:hi]
                    offset += len(data)
                    if offset > end:
                        break
                    chunk = await anext(stream, None)
            finally:
                call.cancel()

        return StreamingResponse(body(), status_code=status, headers=headers)

    @_answering
    async def upload(self, request: Request) -> Response:
        """An input image (or, with Content-Type text/plain, a chat text attachment) as the request body, streamed to
        UploadInput in parts."""
        kind = request.headers.get("content-type", "")
        is_text = kind.split(";", 1)[0].strip().lower() == "text/plain"
        cap = 4 * self.settings.max_input_chars if is_text else self.settings.input_max_bytes

        async def parts() -> AsyncIterator[gateway_pb2.UploadInputRequest]:
            sent = 0
            pending = bytearray()
            if is_text:  # the first part says what the file is; an image's type is left to its bytes
                yield gateway_pb2.UploadInputRequest(content_type="text/plain")
            async for chunk in request.stream():
                pending += chunk
                sent += len(chunk)
                if sent > cap + 1:  # the gateway refuses it by its size; it need not receive all of it
                    break
                while len(pending) >= UPLOAD_PART:
                    yield gateway_pb2.UploadInputRequest(data=bytes(pending[:UPLOAD_PART]))
                    del pending[:UPLOAD_PART]
            yield gateway_pb2.UploadInputRequest(data=bytes(pending))

        resp = await self._call(
            lambda: self.upstream.gateway.UploadInput(parts(), metadata=credentials(request), timeout=self._timeout)
        )
        return JSONResponse(to_json(resp), status_code=201)
