"""Per-tenant submission limits that hold across every submit replica, kept in PostgreSQL."""

from __future__ import annotations

from taskgate import errors, telemetry
from taskgate.store.submissions import Budget
from taskgate_api import reasons


def rate_limited(per_minute: int, retry_after: float) -> errors.ApiError:
    """RESOURCE_EXHAUSTED with RetryInfo for a tenant whose minute window is full."""
    telemetry.SUBMIT_REJECTIONS.labels(reasons.RATE_LIMITED).inc()
    return errors.resource_exhausted(
        reasons.RATE_LIMITED,
        f"more than {per_minute} submissions this minute",
        retry_after=max(retry_after, 0.001),
        limit=str(per_minute),
    )


def quota_exceeded(budget: Budget, retry_after: float) -> errors.ApiError:
    """RESOURCE_EXHAUSTED with RetryInfo (until the window resets) for a submission whose estimated GPU-seconds do
    not fit what is left of the tenant's budget."""
    telemetry.SUBMIT_REJECTIONS.labels(reasons.QUOTA_EXCEEDED).inc()
    return errors.resource_exhausted(
        reasons.QUOTA_EXCEEDED,
        f"this task is estimated at {budget.estimate:.1f} GPU-seconds and the tenant's budget has "
        f"{budget.left:.1f} left this {budget.window} (UTC)",
        retry_after=retry_after,
        window=budget.window,
        gpu_seconds_left=f"{budget.left:.3f}",
        gpu_seconds_estimate=f"{budget.estimate:.3f}",
    )


def too_many_pending(limit: int) -> errors.ApiError:
    """RESOURCE_EXHAUSTED for a tenant already holding `limit` unfinished tasks."""
    telemetry.SUBMIT_REJECTIONS.labels(reasons.TOO_MANY_PENDING_TASKS).inc()
    return errors.resource_exhausted(
        reasons.TOO_MANY_PENDING_TASKS, f"at most {limit} unfinished tasks per tenant; wait for one to finish", limit=str(limit)
    )
