"""The taskgate client SDK: blocking and asyncio clients, typed errors, and webhook verification.

    from taskgate_client import connect

    with connect("127.0.0.1:50051", api_key="tg_...") as client:
        task = client.submit("a red fox running through snow", frames=9, width=32, height=32)
        done = client.wait(task.task_id, timeout=120)
        client.download(done.task_id, "fox.mp4")
"""

from taskgate_client.aio import AsyncTaskgateClient, connect_async
from taskgate_client.config import ClientConfig, make_config
from taskgate_client.errors import (
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
from taskgate_client.sync import TaskgateClient, connect
from taskgate_client.types import Status, Task, TaskEvent, TaskResult
from taskgate_client.webhooks import WebhookVerificationError, verify_webhook

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
