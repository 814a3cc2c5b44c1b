"""CancelSignal: a core-NATS hint that tells the worker running a task to look at its row now.

A lost signal costs only time: the worker's next lease renewal or progress write is refused anyway.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass

from nats.errors import Error as NatsError
from opentelemetry.trace import SpanKind

from taskgate import bus as busmod
from taskgate import ids, tracing
from taskgate_api.v1 import task_pb2

log = logging.getLogger("taskgate.cancel")

SUBJECT = busmod.CANCEL_SUBJECT


@dataclass(frozen=True, slots=True)
class Signal:
    """A decoded cancel signal."""

    task_id: int
    hard: bool
    reason: str


def encode(task_id: int, *, hard: bool, reason: str) -> bytes:
    """The CancelSignal payload."""
    return task_pb2.CancelSignal(task_id=str(task_id), hard=hard, reason=reason).SerializeToString()


def decode(data: bytes) -> Signal | None:
    """The signal a message carries, or None when it is not a valid one."""
    try:
        msg = task_pb2.CancelSignal.FromString(data)
    except Exception:  # protobuf raises DecodeError and, on some inputs, other errors
        return None
    task_id = ids.parse(msg.task_id)
    return Signal(task_id, msg.hard, msg.reason) if task_id is not None else None


async def send(
    bus: busmod.Bus, task_id: int, *, hard: bool, reason: str, trace_context: Mapping[str, str] | None = None
) -> bool:
    """Publishes the signal, in the task's trace (`trace_context`: the row's); False (logged) when NATS refused it."""
    try:
        with tracing.span(
            "cancel signal", parent=trace_context, kind=SpanKind.PRODUCER, attributes={tracing.TASK_ID: str(task_id)}
        ):
            await bus.nc.publish(SUBJECT, encode(task_id, hard=hard, reason=reason), headers=tracing.carrier())
    except (NatsError, OSError) as exc:
        log.warning("cancel signal not sent", extra={"task_id": str(task_id), "error": type(exc).__name__})
        return False
    return True
