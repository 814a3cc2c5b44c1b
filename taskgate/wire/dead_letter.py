"""The dead-letter notice: a JSON message on the TASK_DEAD_LETTERS stream for a task failed for good.

The dead_letter table row is the record; this message is a notification for whoever watches the stream.
"""

from __future__ import annotations

import json
import logging
from datetime import UTC, datetime

from opentelemetry.trace import SpanKind

from taskgate import bus as busmod
from taskgate import tracing
from taskgate.model import TaskRow

log = logging.getLogger("taskgate.dead_letter")


def encode(task: TaskRow, *, reason: str, error_code: str, error_message: str) -> bytes:
    """The notice's JSON body."""
    body = {
        "task_id": str(task.id),
        "model_id": task.model_id,
        "user_id": task.user_id,
        "reason": reason,
        "error_code": error_code,
        "error_message": error_message,
        "attempt": task.attempt,
        "retry_count": task.retry_count,
        "at": datetime.now(UTC).isoformat(),
    }
    return json.dumps(body).encode()


async def publish(bus: busmod.Bus, task: TaskRow, *, reason: str, error_code: str, error_message: str) -> bool:
    """Publishes the notice (one per task: its message id is the task's); False (logged) when it failed."""
    try:
        with tracing.span(
            "dead letter", parent=task.trace_context, kind=SpanKind.PRODUCER, attributes={tracing.TASK_ID: str(task.id)}
        ):
            await bus.js.publish(
                busmod.dead_subject(task.model_id),
                encode(task, reason=reason, error_code=error_code, error_message=error_message),
                headers=tracing.headers({"Nats-Msg-Id": f"{task.id}.dead"}),
            )
    except Exception:  # the row is the record; the stream is a notification
        log.warning("dead-letter publish failed", extra={"task_id": str(task.id)}, exc_info=True)
        return False
    return True
