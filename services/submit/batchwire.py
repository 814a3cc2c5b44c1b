"""What a batch reads and answers: the `file-<n>` and `batch_<n>` ids, the StoredFile and Batch protos of their rows,
an input file's JSONL lines parsed into requests (or each line's error), and which refusals of a line a batch waits
out (rate limits, the pending limit, a backend away) against those that are the line's error.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf import json_format
from google.rpc import error_details_pb2

from taskgate import errors, ids
from taskgate.model import timestamp
from taskgate.store.batches import BatchRow, FileRow
from taskgate_api import reasons
from taskgate_api.v1 import batches_pb2, gateway_pb2

FILE_PREFIX = "file-"
BATCH_PREFIX = "batch_"
# refusals a batch waits out (its chunk is sent again), by gRPC status and reason
PASSING = {
    reasons.RATE_LIMITED,
    reasons.TOO_MANY_PENDING_TASKS,
    reasons.TENANT_RATE_LIMITED,
    reasons.BACKEND_UNAVAILABLE,
}


def file_id(text: str, field_name: str = "file_id") -> int:
    """The number of a `file-<n>` id, or INVALID_ARGUMENT naming the field."""
    value = ids.parse(text.removeprefix(FILE_PREFIX)) if text.startswith(FILE_PREFIX) else None
    if value is None:
        raise errors.invalid_argument([(field_name, f"must be a file id ({FILE_PREFIX}…)")])
    return value


def batch_id(text: str) -> int:
    """The number of a `batch_<n>` id, or INVALID_ARGUMENT."""
    value = ids.parse(text.removeprefix(BATCH_PREFIX)) if text.startswith(BATCH_PREFIX) else None
    if value is None:
        raise errors.invalid_argument([("batch_id", f"must be a batch id ({BATCH_PREFIX}…)")])
    return value


def file_proto(row: FileRow) -> batches_pb2.StoredFile:
    out = batches_pb2.StoredFile(
        id=f"{FILE_PREFIX}{row.id}", purpose=row.purpose, filename=row.filename, size_bytes=row.size_bytes,
        sha256=row.sha256, created_at=timestamp(row.created_at),
    )
    if row.batch_id is not None:
        out.batch_id = f"{BATCH_PREFIX}{row.batch_id}"
    return out


def batch_proto(row: BatchRow) -> batches_pb2.Batch:
    out = batches_pb2.Batch(
        id=f"{BATCH_PREFIX}{row.id}",
        input_file_id=f"{FILE_PREFIX}{row.input_file_id}",
        endpoint=row.endpoint,
        completion_window=row.completion_window,
        status=row.status,
        metadata=row.metadata,
        end_user=row.end_user,
        error_message=row.error_message or "",
        created_at=timestamp(row.created_at),
        expires_at=timestamp(row.expires_at),
        counts=batches_pb2.BatchCounts(total=row.total_lines or 0, completed=row.done, failed=row.failed),
    )
    if row.source_file_id is not None:
        out.source_file_id = f"{FILE_PREFIX}{row.source_file_id}"
    if row.output_file_id is not None:
        out.output_file_id = f"{FILE_PREFIX}{row.output_file_id}"
    if row.error_file_id is not None:
        out.error_file_id = f"{FILE_PREFIX}{row.error_file_id}"
    for name, moment in row.moments.items():
        if moment is not None:
            getattr(out, name).CopyFrom(timestamp(moment))
    return out


def jsonl_lines(data: bytes) -> list[bytes]:
    """The non-blank lines of a JSONL file."""
    return [line for line in data.split(b"\n") if line.strip()]


@dataclass
class Line:
    """One input line as read: its custom_id and its request, or why it cannot be submitted."""

    custom_id: str
    request: gateway_pb2.SubmitTaskRequest | None = None
    error: dict[str, Any] | None = None


def parse_line(raw: bytes, number: int) -> Line:
    """A line of a batch input: `{"custom_id": ..., "request": SubmitTaskRequest}` or `{"custom_id": ..., "error":
    ...}`."""
    try:
        data = json.loads(raw)
    except ValueError as exc:
        return Line(f"line-{number}", error={"code": "invalid_json", "message": f"line {number + 1}: not JSON: {exc}"})
    if not isinstance(data, dict):
        return Line(
            f"line-{number}", error={"code": "invalid_json", "message": f"line {number + 1}: not a JSON object"}
        )
    custom_id = data.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        return Line(
            f"line-{number}", error={"code": "missing_custom_id", "message": f"line {number + 1}: no custom_id"}
        )
    if isinstance(data.get("error"), dict):
        return Line(custom_id, error=data["error"])
    body = data.get("request")
    if not isinstance(body, dict):
        return Line(custom_id, error={"code": "invalid_request", "message": f"line {number + 1}: no request object"})
    request = gateway_pb2.SubmitTaskRequest()
    try:
        json_format.ParseDict(body, request)
    except (json_format.ParseError, TypeError, AttributeError) as exc:
        return Line(custom_id, error={"code": "invalid_request", "message": f"line {number + 1}: {exc}"})
    return Line(custom_id, request=request)


def refusal(exc: errors.ApiError) -> dict[str, Any]:
    """A refused line's error as recorded: the gRPC status as SubmitTasks would answer it (proto3 JSON)."""
    return json_format.MessageToDict(exc.status_proto, preserving_proto_field_name=True)


def passing(exc: errors.ApiError) -> float | None:
    """Seconds to wait before sending a line again when its refusal passes; None when it is the line's error."""
    reason, delay = "", 1.0
    for detail in exc.status_proto.details:
        if detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
            got = error_details_pb2.ErrorInfo()
            detail.Unpack(got)
            reason = got.reason
        elif detail.Is(error_details_pb2.RetryInfo.DESCRIPTOR):
            wait = error_details_pb2.RetryInfo()
            detail.Unpack(wait)
            delay = wait.retry_delay.ToTimedelta().total_seconds()
    if exc.code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.ABORTED) or reason in PASSING:
        return max(delay, 0.05)
    return None
