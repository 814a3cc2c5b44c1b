"""What TaskAdmin (services/scheduler/admin.py) translates between its protos and the core's values: durations, task
states, state counts, requeue items, a purge's kept tasks, a request's timestamps."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime

from google.protobuf.duration_pb2 import Duration
from google.protobuf.timestamp_pb2 import Timestamp

from services.scheduler.requeue import Item
from taskgate import errors
from taskgate.states import Status
from taskgate.store import admin as admin_store
from taskgate.store import maintenance
from taskgate_api.v1 import admin_pb2, task_pb2


def duration(seconds: float) -> Duration:
    d = Duration()
    d.FromNanoseconds(int(max(seconds, 0.0) * 1e9))
    return d


def statuses(values: Sequence[int], field: str) -> list[Status]:
    try:
        return [Status.from_proto(v) for v in values]
    except ValueError:
        raise errors.invalid_argument([(field, "unknown or unspecified task status")]) from None


def state_counts(counts: list[admin_store.StateCount]) -> list[admin_pb2.StateCount]:
    return [
        admin_pb2.StateCount(
            model_id=c.model_id, status=c.status.to_proto(), count=c.count,
            priority=c.priority if c.priority is not None else task_pb2.PRIORITY_UNSPECIFIED,  # type: ignore[arg-type]
        )
        for c in counts
    ]


def kept(counts: maintenance.RetentionCounts) -> list[admin_pb2.PurgeKept]:
    """The finished tasks a purge at that cut-off leaves in place, by reason (reasons with none left out)."""
    reasons = (("webhook_undelivered", counts.kept_webhook), ("attempt_running", counts.kept_running))
    return [admin_pb2.PurgeKept(reason=reason, tasks=n) for reason, n in reasons if n]


def requeue_item(item: Item) -> admin_pb2.RequeueItem:
    return admin_pb2.RequeueItem(
        task_id=str(item.task_id),
        from_status=item.from_status.to_proto() if item.from_status else task_pb2.TASK_STATUS_UNSPECIFIED,
        action=item.outcome.value,
        detail=item.detail,
    )


def moment(value: Timestamp, name: str, bad: list[tuple[str, str]]) -> datetime:
    """A request's timestamp as a datetime; out of the years 1-9999 is a violation (and answers now)."""
    try:
        return value.ToDatetime(tzinfo=UTC)
    except (ValueError, OverflowError):
        bad.append((name, "must be a time between the years 1 and 9999"))
        return datetime.now(UTC)
