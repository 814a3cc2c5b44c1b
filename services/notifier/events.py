"""task_event rows as wire messages: the TaskEvent the relay publishes and the streams replay."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from taskgate.model import timestamp
from taskgate.states import Status
from taskgate.v1 import task_pb2


def event_proto(row: Mapping[str, Any]) -> task_pb2.TaskEvent:
    """One history row (a task_event record) as a TaskEvent."""
    msg = task_pb2.TaskEvent(
        task_id=str(row["task_id"]),
        user_id=row["user_id"],
        model_id=row["model_id"],
        version=row["version"],
        to_status=Status(row["to_status"]).to_proto(),
        progress=row["progress"],
        error_code=row["error_code"] or "",
        error_message=row["error_msg"] or "",
        attempt=row["attempt"],
        worker_id=row["worker_id"] or "",
        reason=row["reason"] or "",
        actor=row["actor"],
        event_id=row["id"],
    )
    if row["from_status"] is not None:
        msg.from_status = Status(row["from_status"]).to_proto()
    msg.at.CopyFrom(timestamp(row["at"]))
    if row["result_uri"]:
        msg.result.CopyFrom(
            task_pb2.TaskResult(
                uri=row["result_uri"],
                content_type=row["result_content_type"] or "",
                size_bytes=row["result_size"] or 0,
                sha256=row["result_sha256"] or "",
            )
        )
    return msg


def msg_id(task_id: int | str, version: int) -> str:
    """The JetStream dedup id of one event: a replayed publish of the same version is dropped."""
    return f"{task_id}.v{version}"


def is_terminal(event: task_pb2.TaskEvent) -> bool:
    """Whether the event moved its task into a terminal state."""
    return Status.from_proto(event.to_status).terminal if event.to_status else False
