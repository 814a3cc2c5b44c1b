"""The taskgate client SDK: blocking and asyncio clients, typed errors, and webhook verification.

    from taskgate.client import connect

    with connect("127.0.0.1:50051", api_key="tg_...") as client:
        task = client.submit("a red fox running through snow", frames=9, width=32, height=32)
        done = client.wait(task.task_id, timeout=120)
        client.download(done.task_id, "fox.mp4")
"""

from taskgate.client.aio import AsyncTaskgateClient, connect_async
from taskgate.client.config import ClientConfig, make_config
from taskgate.client.errors import (
    AlreadyExists,
    DeadlineExceeded,
    FailedPrecondition,
    FieldViolation,
    IntegrityError,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    ResourceExhausted,
    TaskgateError,
    Unauthenticated,
    Unavailable,
    WaitTimeout,
)
from taskgate.client.sync import TaskgateClient, connect
from taskgate.client.types import Task, TaskEvent, TaskResult
from taskgate.client.webhooks import WebhookVerificationError, verify_webhook
from taskgate.states import Status

__all__ = [
    "AlreadyExists",
    "AsyncTaskgateClient",
    "ClientConfig",
    "DeadlineExceeded",
    "FailedPrecondition",
    "FieldViolation",
    "IntegrityError",
    "InvalidArgument",
    "NotFound",
    "PermissionDenied",
    "ResourceExhausted",
    "Status",
    "Task",
    "TaskEvent",
    "TaskResult",
    "TaskgateClient",
    "TaskgateError",
    "Unauthenticated",
    "Unavailable",
    "WaitTimeout",
    "WebhookVerificationError",
    "connect",
    "connect_async",
    "make_config",
    "verify_webhook",
]
