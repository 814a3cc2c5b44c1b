"""The taskgate client SDK: blocking and asyncio clients, typed errors, and webhook verification.

    from taskgate_client import connect

    with connect("127.0.0.1:50051", api_key="tg_...") as client:
        task = client.submit("a red fox running through snow", frames=9, width=32, height=32)
        done = task.wait(timeout=120)
        done.download("fox.mp4")
        # or in one call: client.run("a red fox running through snow", output="fox.mp4")
"""

from taskgate_api.version import __version__
from taskgate_client.aio import AsyncEventStream, AsyncTaskgateClient, connect_async
from taskgate_client.config import ClientConfig, make_config
from taskgate_client.errors import (
    Aborted,
    AlreadyExists,
    DeadlineExceeded,
    FailedPrecondition,
    FieldViolation,
    IntegrityError,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    ResourceExhausted,
    TaskFailed,
    TaskgateError,
    Unauthenticated,
    Unavailable,
    WaitTimeout,
)
from taskgate_client.handles import AsyncTaskHandle, TaskHandle
from taskgate_client.streaming import Output, Preview, TextAssembler, TextDelta
from taskgate_client.sync import EventStream, TaskgateClient, connect
from taskgate_client.tokens import mint_client_token
from taskgate_client.types import (
    ChatInput,
    ChatOptions,
    ImageSource,
    InputImage,
    InputText,
    Status,
    SubmitItem,
    SubmitOptions,
    Task,
    TaskEvent,
    TaskResult,
    TextAnswer,
)
from taskgate_client.webhooks import WebhookVerificationError, verify_webhook

__all__ = [
    "Aborted",
    "AlreadyExists",
    "AsyncEventStream",
    "AsyncTaskHandle",
    "AsyncTaskgateClient",
    "ChatInput",
    "ChatOptions",
    "ClientConfig",
    "DeadlineExceeded",
    "EventStream",
    "FailedPrecondition",
    "FieldViolation",
    "ImageSource",
    "InputImage",
    "InputText",
    "IntegrityError",
    "InvalidArgument",
    "NotFound",
    "Output",
    "PermissionDenied",
    "Preview",
    "ResourceExhausted",
    "Status",
    "SubmitItem",
    "SubmitOptions",
    "Task",
    "TaskEvent",
    "TaskFailed",
    "TaskHandle",
    "TaskResult",
    "TaskgateClient",
    "TaskgateError",
    "TextAnswer",
    "TextAssembler",
    "TextDelta",
    "Unauthenticated",
    "Unavailable",
    "WaitTimeout",
    "WebhookVerificationError",
    "__version__",
    "connect",
    "connect_async",
    "make_config",
    "mint_client_token",
    "verify_webhook",
]
