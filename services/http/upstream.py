"""The gRPC services behind the HTTP face, and their answers in HTTP terms.

The HTTP service holds no rules of its own: every request becomes the gRPC call the SDK would make, with the
caller's `Authorization` header as its metadata, and every gRPC status becomes an HTTP status with a JSON body in
the shape of Google's JSON errors (`{"error": {"code", "status", "message", "details"}}`), the google.rpc details
kept (field violations, reasons, retry delays) and a `Retry-After` header on 429 and 503.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, cast

import grpc
from google.protobuf import json_format
from google.protobuf.message import Message
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status
from starlette.requests import Request
from starlette.responses import JSONResponse

from taskgate import channels
from taskgate.config import HttpSettings
from taskgate_api.v1 import admin_pb2_grpc, events_pb2_grpc, gateway_pb2_grpc

# google.rpc.Code -> HTTP status, as Google's APIs map them (google/rpc/code.proto).
HTTP_STATUS: dict[grpc.StatusCode, int] = {
    grpc.StatusCode.OK: 200,
    grpc.StatusCode.CANCELLED: 499,
    grpc.StatusCode.UNKNOWN: 500,
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.ALREADY_EXISTS: 409,
    grpc.StatusCode.PERMISSION_DENIED: 403,
    grpc.StatusCode.UNAUTHENTICATED: 401,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.FAILED_PRECONDITION: 400,
    grpc.StatusCode.ABORTED: 409,
    grpc.StatusCode.OUT_OF_RANGE: 400,
    grpc.StatusCode.UNIMPLEMENTED: 501,
    grpc.StatusCode.INTERNAL: 500,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DATA_LOSS: 500,
}
_CODES = {code.value[0]: code for code in grpc.StatusCode}


def to_json(message: Message) -> dict[str, Any]:
    """A protobuf message in the proto3 JSON mapping with the .proto's own (snake_case) field names: int64 as strings,
    enums by name, timestamps in RFC 3339; fields at their default value are left out, as in gRPC."""
    return json_format.MessageToDict(message, preserving_proto_field_name=True)


def _retry_after(details: list[dict[str, Any]], status: int, raw: list[Any]) -> str | None:
    for detail in raw:
        if detail.Is(error_details_pb2.RetryInfo.DESCRIPTOR):
            info = error_details_pb2.RetryInfo()
            detail.Unpack(info)
            return str(max(1, math.ceil(info.retry_delay.ToTimedelta().total_seconds())))
    return "1" if status == 503 else None


def error_response(code: grpc.StatusCode, message: str, status: status_pb2.Status | None = None) -> JSONResponse:
    """The HTTP answer of a gRPC status: its HTTP code, the JSON error body, Retry-After where it helps."""
    http = HTTP_STATUS.get(code, 500)
    raw = list(status.details) if status is not None else []
    details = [json_format.MessageToDict(d, preserving_proto_field_name=True) for d in raw]
    body = {"error": {"code": http, "status": code.name, "message": message, "details": details}}
    headers: dict[str, str] = {}
    if http in (429, 503) and (after := _retry_after(details, http, raw)) is not None:
        headers["retry-after"] = after
    return JSONResponse(body, status_code=http, headers=headers)


def rpc_error_response(exc: grpc.aio.AioRpcError) -> JSONResponse:
    """The HTTP answer of a failed gRPC call, its google.rpc details kept."""
    return error_response(exc.code(), exc.details() or "", rpc_status.from_call(exc))


def invalid(violations: list[tuple[str, str]]) -> JSONResponse:
    """400 INVALID_ARGUMENT naming each bad part of the HTTP request (a query parameter, a header, the body)."""
    bad = error_details_pb2.BadRequest(
        field_violations=[error_details_pb2.BadRequest.FieldViolation(field=f, description=d) for f, d in violations]
    )
    status = status_pb2.Status(code=grpc.StatusCode.INVALID_ARGUMENT.value[0])
    status.details.add().Pack(bad)
    summary = "; ".join(f"{f}: {d}" for f, d in violations)
    return error_response(grpc.StatusCode.INVALID_ARGUMENT, f"invalid request: {summary}", status)


def status_code_of(value: int) -> grpc.StatusCode:
    """The grpc.StatusCode of a google.rpc.Code number."""
    return _CODES.get(value, grpc.StatusCode.UNKNOWN)


@dataclass
class Upstream:
    """Channels to the gRPC services the HTTP face calls, shared by every request."""

    gateway: gateway_pb2_grpc.TaskGatewayAsyncStub
    events: events_pb2_grpc.TaskEventsAsyncStub
    admin: admin_pb2_grpc.TaskAdminAsyncStub
    channels: list[grpc.aio.Channel]
    timeout: float

    @classmethod
    def connect(cls, settings: HttpSettings) -> Upstream:
        """Opens (lazily) one channel per service; targets from the http_*_target settings or the local ports."""
        def channel(target: str | None, port: int) -> grpc.aio.Channel:
            options = [
                ("grpc.max_receive_message_length", settings.grpc_max_message_bytes),
                ("grpc.max_send_message_length", settings.grpc_max_message_bytes),
                ("grpc.keepalive_time_ms", 30_000),
                ("grpc.lb_policy_name", "round_robin"),  # a headless Service's name: every ready pod
            ]
            return channels.channel(settings, target or channels.local_target(settings, port), options)

        gateway = channel(settings.http_gateway_target, settings.submit_port)
        events = channel(settings.http_events_target, settings.notifier_port)
        admin = channel(settings.http_admin_target, settings.scheduler_port)
        return cls(
            gateway=cast("gateway_pb2_grpc.TaskGatewayAsyncStub", gateway_pb2_grpc.TaskGatewayStub(gateway)),
            events=cast("events_pb2_grpc.TaskEventsAsyncStub", events_pb2_grpc.TaskEventsStub(events)),
            admin=cast("admin_pb2_grpc.TaskAdminAsyncStub", admin_pb2_grpc.TaskAdminStub(admin)),
            channels=[gateway, events, admin],
            timeout=settings.http_call_timeout_seconds,
        )

    async def close(self) -> None:
        for channel in self.channels:
            await channel.close()


def credentials(request: Request) -> list[tuple[str, str]]:
    """The gRPC metadata of an HTTP request: its Authorization header as it came (the services check it), and the
    client's traceparent when it sent one."""
    authorization = request.headers.get("authorization", "")
    if not authorization and request.method == "GET" and (token := request.query_params.get("access_token")):
        # a browser's EventSource cannot set headers: a client token may come as ?access_token= on a GET
        authorization = f"Bearer {token}"
    metadata = [("authorization", authorization)]
    if traceparent := request.headers.get("traceparent"):
        metadata.append(("traceparent", traceparent))
    return metadata
