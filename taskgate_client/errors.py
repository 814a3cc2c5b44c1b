"""Typed exceptions for gRPC errors, carrying the google.rpc details the gateway sends."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import grpc
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status

if TYPE_CHECKING:
    from taskgate_client.types import Task


@dataclass(frozen=True, slots=True)
class FieldViolation:
    """One bad request field and why it was refused."""

    field: str
    description: str


class TaskgateError(Exception):
    """Any error the gateway (or the transport to it) reported; subclasses name the status code."""

    def __init__(
        self,
        code: grpc.StatusCode,
        message: str,
        *,
        reason: str = "",
        domain: str = "",
        metadata: dict[str, str] | None = None,
        field_violations: list[FieldViolation] | None = None,
        retry_delay: float | None = None,
    ) -> None:
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message
        self.reason = reason
        self.domain = domain
        self.metadata = metadata or {}
        self.field_violations = field_violations or []
        self.retry_delay = retry_delay

    @property
    def code_name(self) -> str:
        """The status code's name, e.g. "NOT_FOUND"."""
        return str(self.code.name)

    def to_dict(self) -> dict[str, object]:
        """A JSON-ready description (for the CLI's --json output)."""
        return {
            "code": self.code_name,
            "message": self.message,
            "reason": self.reason,
            "metadata": self.metadata,
            "field_violations": [{"field": v.field, "description": v.description} for v in self.field_violations],
            "retry_delay": self.retry_delay,
        }


class NotFound(TaskgateError):
    """NOT_FOUND: no such task for this tenant."""


class InvalidArgument(TaskgateError):
    """INVALID_ARGUMENT: see `field_violations`."""


class ResourceExhausted(TaskgateError):
    """RESOURCE_EXHAUSTED: a rate or pending limit; `retry_delay` says when to try again."""


class Unauthenticated(TaskgateError):
    """UNAUTHENTICATED: missing or unknown API key."""


class PermissionDenied(TaskgateError):
    """PERMISSION_DENIED: the key may not make this call (e.g. admin calls)."""


class FailedPrecondition(TaskgateError):
    """FAILED_PRECONDITION: the task is not in a state that allows the call (`reason` says which)."""


class AlreadyExists(TaskgateError):
    """ALREADY_EXISTS: e.g. an idempotency key reused with a different request."""


class Unavailable(TaskgateError):
    """UNAVAILABLE: the service or one of its backends is down; safe to retry."""


class Aborted(TaskgateError):
    """ABORTED: a concurrent write conflicted; with `retry_delay` set the same call may simply be sent again."""


class DeadlineExceeded(TaskgateError):
    """DEADLINE_EXCEEDED: the call did not finish within its deadline."""


class IntegrityError(TaskgateError):
    """DATA_LOSS: a downloaded result does not match the size or sha256 the gateway recorded."""


class WaitTimeout(TimeoutError):
    """`wait()` gave up before the task reached a terminal state."""

    def __init__(self, task_id: str, timeout: float) -> None:
        super().__init__(f"task {task_id} did not finish within {timeout:g}s")
        self.task_id = task_id
        self.timeout = timeout


class TaskFailed(Exception):
    """A followed task ended without a result (FAILED, TIMEOUT or CANCELED); `.task` is its final state."""

    def __init__(self, task: Task) -> None:
        why = f": {task.error_code}: {task.error_message}" if task.error_code else ""
        super().__init__(f"task {task.task_id} ended {task.status.value}{why}")
        self.task = task
        self.task_id = task.task_id


_BY_CODE: dict[grpc.StatusCode, type[TaskgateError]] = {
    grpc.StatusCode.NOT_FOUND: NotFound,
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgument,
    grpc.StatusCode.RESOURCE_EXHAUSTED: ResourceExhausted,
    grpc.StatusCode.UNAUTHENTICATED: Unauthenticated,
    grpc.StatusCode.PERMISSION_DENIED: PermissionDenied,
    grpc.StatusCode.FAILED_PRECONDITION: FailedPrecondition,
    grpc.StatusCode.ALREADY_EXISTS: AlreadyExists,
    grpc.StatusCode.UNAVAILABLE: Unavailable,
    grpc.StatusCode.ABORTED: Aborted,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceeded,
    grpc.StatusCode.DATA_LOSS: IntegrityError,
}


@dataclass
class _Parsed:
    reason: str = ""
    domain: str = ""
    metadata: dict[str, str] = field(default_factory=dict)
    violations: list[FieldViolation] = field(default_factory=list)
    retry_delay: float | None = None


def details_of(status: status_pb2.Status) -> list[object]:
    """The google.rpc detail types the gateway sends, unpacked from a status."""
    out: list[object] = []
    for anyp in status.details:
        for cls in (error_details_pb2.BadRequest, error_details_pb2.ErrorInfo, error_details_pb2.RetryInfo):
            if anyp.Is(cls.DESCRIPTOR):
                msg = cls()
                anyp.Unpack(msg)
                out.append(msg)
    return out


def _parse_details(exc: grpc.RpcError) -> _Parsed:
    try:
        status = rpc_status.from_call(exc)
    except ValueError:
        return _Parsed()
    return _parse_status(status) if status is not None else _Parsed()


def _parse_status(status: status_pb2.Status) -> _Parsed:
    out = _Parsed()
    for detail in details_of(status):
        if isinstance(detail, error_details_pb2.ErrorInfo):
            out.reason, out.domain, out.metadata = detail.reason, detail.domain, dict(detail.metadata)
        elif isinstance(detail, error_details_pb2.BadRequest):
            out.violations = [FieldViolation(v.field, v.description) for v in detail.field_violations]
        elif isinstance(detail, error_details_pb2.RetryInfo):
            out.retry_delay = detail.retry_delay.ToNanoseconds() / 1e9
    return out


def retryable(exc: BaseException) -> bool:
    """Whether the SDK sends a failed call again: UNAVAILABLE, or ABORTED that the server marked with RetryInfo."""
    return isinstance(exc, Unavailable) or (isinstance(exc, Aborted) and exc.retry_delay is not None)


def from_rpc_error(exc: grpc.RpcError) -> TaskgateError:
    """The typed exception for a failed call (sync or asyncio), with its google.rpc details unpacked."""
    code_fn = getattr(exc, "code", None)
    details_fn = getattr(exc, "details", None)
    code = code_fn() if callable(code_fn) else grpc.StatusCode.UNKNOWN
    message = (details_fn() if callable(details_fn) else None) or str(code.name)
    parsed = _parse_details(exc)
    cls = _BY_CODE.get(code, TaskgateError)
    return cls(
        code,
        message,
        reason=parsed.reason,
        domain=parsed.domain,
        metadata=parsed.metadata,
        field_violations=parsed.violations,
        retry_delay=parsed.retry_delay,
    )


def from_status(status: status_pb2.Status) -> TaskgateError:
    """The typed exception for one item's error status in a batch answer (SubmitTasks), as for a failed call."""
    code = _CODES.get(status.code, grpc.StatusCode.UNKNOWN)
    parsed = _parse_status(status)
    return _BY_CODE.get(code, TaskgateError)(
        code,
        status.message or str(code.name),
        reason=parsed.reason,
        domain=parsed.domain,
        metadata=parsed.metadata,
        field_violations=parsed.violations,
        retry_delay=parsed.retry_delay,
    )


_CODES = {c.value[0]: c for c in grpc.StatusCode}
