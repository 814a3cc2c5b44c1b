"""gRPC statuses in OpenAI's error shape: `{"error": {"message", "type", "param", "code"}}` with the HTTP statuses
the official client maps to its exceptions (400 BadRequestError, 401 AuthenticationError, 404 NotFoundError, 409
ConflictError, 429 RateLimitError, 5xx InternalServerError).

The gateway's own answer is translated, never second-guessed: its field violations become `param` (in the OpenAI
request's names), its ErrorInfo reason the lower-case `code`, its RetryInfo a `Retry-After` header. The client retries
408, 409, 429 and 5xx by itself; `x-should-retry` tells it which of those a retry cannot mend (a reused idempotency
key, a budget spent for longer than it would wait).
"""

from __future__ import annotations

import json
import math
from typing import Any

import grpc
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status
from starlette.responses import JSONResponse

from taskgate_api import reasons

from ..upstream import HTTP_STATUS

# OpenAI's error types by HTTP status (what its API sends; the client keys on the status, people read the type)
_TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    403: "permission_error",
    404: "invalid_request_error",
    409: "conflict_error",
    429: "rate_limit_error",
}
# taskgate's request fields by the OpenAI parameter that carries them (a violation names the OpenAI one)
PARAMS = {
    "model_id": "model",
    "prompt": "input",
    "chat.messages": "input",
    "chat.max_output_tokens": "max_output_tokens",
    "chat.temperature": "temperature",
    "chat.top_p": "top_p",
    "chat.stop": "stop",
    "chat.seed": "seed",
    "end_user": "user",
    "max_queue_seconds": "completion_window",
    "priority": "completion_window",
}
_NOT_RETRIED = {reasons.IDEMPOTENCY_KEY_REUSED, reasons.PRIORITY_NOT_ALLOWED}
_CODES = {
    reasons.RATE_LIMITED: "rate_limit_exceeded",
    reasons.TENANT_RATE_LIMITED: "rate_limit_exceeded",
    reasons.QUOTA_EXCEEDED: "insufficient_quota",
    reasons.UNAUTHENTICATED: "invalid_api_key",
}


def param_of(field: str) -> str:
    """The OpenAI parameter a taskgate field violation names (`chat.messages[2].role` → `input`)."""
    base = field.split("[", 1)[0]
    return PARAMS.get(base, PARAMS.get(field, field))


def error(
    status: int, message: str, *, param: str | None = None, code: str | None = None, kind: str | None = None,
    headers: dict[str, str] | None = None,
) -> JSONResponse:
    """One error answer in OpenAI's shape."""
    body = {"error": {
        "message": message, "type": kind or _TYPES.get(status, "server_error"), "param": param, "code": code,
    }}
    return JSONResponse(body, status_code=status, headers=headers or {})


def not_found(what: str, ident: str, param: str | None = None) -> JSONResponse:
    """404 for an id the caller holds no such thing under."""
    return error(404, f"No {what} found with id '{ident}'.", param=param, code=f"{what}_not_found")


def invalid(param: str, message: str, code: str | None = None) -> JSONResponse:
    """400 naming the request parameter at fault."""
    return error(400, f"{param}: {message}" if param else message, param=param, code=code or "invalid_value")


def from_status(code: grpc.StatusCode, message: str, status: status_pb2.Status | None) -> JSONResponse:
    """The OpenAI answer of a gRPC status, its details translated."""
    http = HTTP_STATUS.get(code, 500)
    param: str | None = None
    reason: str | None = None
    delay: float | None = None
    for detail in status.details if status is not None else []:
        if detail.Is(error_details_pb2.BadRequest.DESCRIPTOR):
            bad = error_details_pb2.BadRequest()
            detail.Unpack(bad)
            if bad.field_violations:
                param = param_of(bad.field_violations[0].field)
        elif detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
            info = error_details_pb2.ErrorInfo()
            detail.Unpack(info)
            reason = info.reason
        elif detail.Is(error_details_pb2.RetryInfo.DESCRIPTOR):
            info_retry = error_details_pb2.RetryInfo()
            detail.Unpack(info_retry)
            delay = info_retry.retry_delay.ToTimedelta().total_seconds()
    headers: dict[str, str] = {}
    if delay is not None:
        headers["retry-after"] = str(max(1, math.ceil(delay)))
    elif http == 503:
        headers["retry-after"] = "1"
    if reason in _NOT_RETRIED:
        headers["x-should-retry"] = "false"
    kind = "insufficient_quota" if reason == reasons.QUOTA_EXCEEDED else None
    api_code = _CODES.get(reason or "", reason.lower() if reason else None)
    if code is grpc.StatusCode.INVALID_ARGUMENT and api_code == "invalid_argument":
        api_code = "invalid_value"
    return error(http, message or code.name, param=param, code=api_code, kind=kind, headers=headers)


def from_rpc(exc: grpc.aio.AioRpcError) -> JSONResponse:
    """The OpenAI answer of a failed gRPC call."""
    return from_status(exc.code(), exc.details() or "", rpc_status.from_call(exc))


def of_proto(status: status_pb2.Status) -> dict[str, Any]:
    """A google.rpc.Status (one SubmitTasks item's refusal) as an OpenAI error object, its HTTP status beside it."""
    code = {c.value[0]: c for c in grpc.StatusCode}.get(status.code, grpc.StatusCode.UNKNOWN)
    answer = from_status(code, status.message, status)
    body: dict[str, Any] = json.loads(bytes(answer.body))
    return {"status_code": answer.status_code, **body}
