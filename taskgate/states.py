"""The task state machine: the one table of legal moves, mirrored by the database's task_transition table."""

from __future__ import annotations

from enum import StrEnum

from taskgate_api.status import Status as Status  # the wire enum; PostgreSQL's task_status has the same values
from taskgate_api.v1 import task_pb2

TERMINAL: frozenset[Status] = frozenset({Status.SUCCEEDED, Status.FAILED, Status.TIMEOUT, Status.CANCELED})
UNFINISHED: frozenset[Status] = frozenset({Status.CREATED, Status.QUEUED, Status.PROCESSING})

# from -> the states it may move to. PROCESSING->PROCESSING is a progress write or a re-claim after an
# expired lease; QUEUED->QUEUED is a scheduler re-publish; CREATED->PROCESSING is a worker whose
# message outran the submit's CREATED->QUEUED commit.
LEGAL: dict[Status, frozenset[Status]] = {
    Status.CREATED: frozenset({Status.QUEUED, Status.PROCESSING, Status.CANCELED}),
    Status.QUEUED: frozenset({Status.QUEUED, Status.PROCESSING, Status.CANCELED, Status.TIMEOUT}),
    Status.PROCESSING: frozenset(
        {Status.PROCESSING, Status.QUEUED, Status.SUCCEEDED, Status.FAILED, Status.TIMEOUT, Status.CANCELED}
    ),
    Status.SUCCEEDED: frozenset(),
    Status.FAILED: frozenset(),
    Status.TIMEOUT: frozenset(),
    Status.CANCELED: frozenset(),
}


def sources(target: Status) -> list[Status]:
    """The states from which `target` may be entered."""
    return [src for src, dests in LEGAL.items() if target in dests]


def is_legal(src: Status, dst: Status) -> bool:
    return dst in LEGAL[src]


class CallbackStatus(StrEnum):
    """A task's terminal webhook as the task sees it; the values are task.callback_status."""

    NONE = "NONE"  # no callback URL, or the task's last event asked for no webhook
    PENDING = "PENDING"  # a terminal webhook is owed or being retried
    DELIVERED = "DELIVERED"
    FAILED = "FAILED"  # the retry schedule ran out

    def to_proto(self) -> task_pb2.CallbackStatus.ValueType:
        return task_pb2.CallbackStatus.Value(f"CALLBACK_STATUS_{self.value}")


# from -> the callback states it may move to (taskgate.store.webhooks refuses any other). PENDING -> PENDING is a
# retry scheduled, or a redelivery mid-round; a redelivery starts a new round (DELIVERED/FAILED -> PENDING). NONE
# is final: a task with it has no URL, or its terminal event asked for no webhook, so it has none to redeliver.
CALLBACK_LEGAL: dict[CallbackStatus, frozenset[CallbackStatus]] = {
    CallbackStatus.NONE: frozenset(),
    CallbackStatus.PENDING: frozenset(
        {CallbackStatus.NONE, CallbackStatus.DELIVERED, CallbackStatus.FAILED, CallbackStatus.PENDING}
    ),
    CallbackStatus.DELIVERED: frozenset({CallbackStatus.PENDING}),
    CallbackStatus.FAILED: frozenset({CallbackStatus.PENDING}),
}


class Priority:
    """Wire priorities; NORMAL when unspecified."""

    LOW = 1
    NORMAL = 5
    HIGH = 10
    ALL = (LOW, NORMAL, HIGH)
    NAMES = {LOW: "low", NORMAL: "normal", HIGH: "high"}  # the one table of their names (subjects, consumers, messages)
