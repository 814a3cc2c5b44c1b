"""gRPC errors with google.rpc details: raise ApiError anywhere; the server interceptor sends it."""

from __future__ import annotations

import grpc
from google.protobuf import any_pb2, duration_pb2
from google.rpc import code_pb2, error_details_pb2, status_pb2
from grpc_status import rpc_status

from taskgate_api import reasons


class ApiError(Exception):
    """An error meant for the caller, carrying a full google.rpc.Status."""

    def __init__(self, code: grpc.StatusCode, message: str, *details: object) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        packed = []
        for detail in details:
            anyp = any_pb2.Any()
            anyp.Pack(detail)  # type: ignore[arg-type]
            packed.append(anyp)
        self.status_proto = status_pb2.Status(code=code.value[0], message=message, details=packed)

    def to_status(self) -> grpc.Status:
        return rpc_status.to_status(self.status_proto)


def _info(reason: str, **metadata: str) -> error_details_pb2.ErrorInfo:
    return error_details_pb2.ErrorInfo(reason=reason, domain=reasons.DOMAIN, metadata=metadata)


def _retry(seconds: float) -> error_details_pb2.RetryInfo:
    delay = duration_pb2.Duration()
    delay.FromNanoseconds(int(max(seconds, 0.001) * 1e9))
    return error_details_pb2.RetryInfo(retry_delay=delay)


def invalid_argument(violations: list[tuple[str, str]]) -> ApiError:
    """INVALID_ARGUMENT naming each bad field."""
    request = error_details_pb2.BadRequest(
        field_violations=[error_details_pb2.BadRequest.FieldViolation(field=f, description=d) for f, d in violations]
    )
    summary = "; ".join(f"{f}: {d}" for f, d in violations)
    return ApiError(grpc.StatusCode.INVALID_ARGUMENT, f"invalid request: {summary}", request)


def resource_exhausted(reason: str, message: str, retry_after: float | None = None, **metadata: str) -> ApiError:
    details: list[object] = [_info(reason, **metadata)]
    if retry_after is not None:
        details.append(_retry(retry_after))
    return ApiError(grpc.StatusCode.RESOURCE_EXHAUSTED, message, *details)


def not_found(what: str = "task") -> ApiError:
    return ApiError(grpc.StatusCode.NOT_FOUND, f"{what} not found", _info(reasons.NOT_FOUND))


def failed_precondition(reason: str, message: str, **metadata: str) -> ApiError:
    return ApiError(grpc.StatusCode.FAILED_PRECONDITION, message, _info(reason, **metadata))


def already_exists(reason: str, message: str, **metadata: str) -> ApiError:
    return ApiError(grpc.StatusCode.ALREADY_EXISTS, message, _info(reason, **metadata))


def unauthenticated(message: str = "missing or unknown API key") -> ApiError:
    return ApiError(grpc.StatusCode.UNAUTHENTICATED, message, _info(reasons.UNAUTHENTICATED))


def permission_denied(message: str, reason: str = reasons.PERMISSION_DENIED, **metadata: str) -> ApiError:
    return ApiError(grpc.StatusCode.PERMISSION_DENIED, message, _info(reason, **metadata))


def unavailable(message: str, retry_after: float = 1.0) -> ApiError:
    return ApiError(grpc.StatusCode.UNAVAILABLE, message, _info(reasons.BACKEND_UNAVAILABLE), _retry(retry_after))


def aborted(reason: str, message: str, retry_after: float = 0.05) -> ApiError:
    """ABORTED with RetryInfo: a concurrency conflict the same request, sent again, gets past."""
    return ApiError(grpc.StatusCode.ABORTED, message, _info(reason), _retry(retry_after))


def internal(request_id: str | None) -> ApiError:
    return ApiError(grpc.StatusCode.INTERNAL, f"internal error (request id {request_id})", _info(reasons.INTERNAL))


__all__ = ["ApiError", "code_pb2"]
