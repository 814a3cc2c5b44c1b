"""A task's state, one enum for the server's state machine (taskgate.states), the SDK and the wire."""

from __future__ import annotations

from taskgate_api._compat import StrEnum
from taskgate_api.v1 import task_pb2


class Status(StrEnum):
    """A task's state, as the wire names it (TASK_STATUS_<name>); PostgreSQL's task_status has the same values."""

    CREATED = "CREATED"
    QUEUED = "QUEUED"
    PROCESSING = "PROCESSING"
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"
    TIMEOUT = "TIMEOUT"
    CANCELED = "CANCELED"

    @property
    def terminal(self) -> bool:
        return self in (Status.SUCCEEDED, Status.FAILED, Status.TIMEOUT, Status.CANCELED)

    def to_proto(self) -> task_pb2.TaskStatus.ValueType:
        return task_pb2.TaskStatus.Value(f"TASK_STATUS_{self.value}")

    @classmethod
    def from_proto(cls, value: int) -> Status:
        return cls(task_pb2.TaskStatus.Name(value).removeprefix("TASK_STATUS_"))  # type: ignore[arg-type]
