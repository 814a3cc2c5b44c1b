"""PreemptSignal: a core-NATS hint from the scheduler to the worker running a task: checkpoint it at its next step and
release it, for a waiting task of higher priority.

The payload is a CancelSignal message (task id, reason) on its own subject: the same few fields, no new wire type. A
lost signal costs only time: the scheduler's scan asks again once the task's preemption window has passed.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

from nats.errors import Error as NatsError
from opentelemetry.trace import SpanKind

from taskgate import bus as busmod
from taskgate import ids, tracing
from taskgate_api.v1 import task_pb2

log = logging.getLogger("taskgate.preempt")

SUBJECT = busmod.PREEMPT_SUBJECT
REASON = "PREEMPTED"  # the release's reason, as its event and webhooks show it


def encode(task_id: int) -> bytes:
    """The signal's payload."""
    return task_pb2.CancelSignal(task_id=str(task_id), hard=False, reason=REASON).SerializeToString()


def decode(data: bytes) -> int | None:
    """The task a message names, or None when it is not a valid signal."""
    try:
        msg = task_pb2.CancelSignal.FromString(data)
    except Exception:  # protobuf raises DecodeError and, on some inputs, other errors
        return None
    return ids.parse(msg.task_id)


async def send(bus: busmod.Bus, task_id: int, *, trace_context: Mapping[str, str] | None = None) -> bool:
    """Publishes the signal in the task's trace; False (logged) when NATS refused it."""
    try:
        with tracing.span(
            "preempt signal", parent=trace_context, kind=SpanKind.PRODUCER, attributes={tracing.TASK_ID: str(task_id)}
        ):
            await bus.nc.publish(SUBJECT, encode(task_id), headers=tracing.carrier())
    except (NatsError, OSError) as exc:
        log.warning("preempt signal not sent", extra={"task_id": str(task_id), "error": type(exc).__name__})
        return False
    return True
