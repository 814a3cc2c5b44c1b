"""Per-tenant submission limits that hold across every submit replica, kept in PostgreSQL."""

from __future__ import annotations

from taskgate import errors, telemetry

RATE_LIMITED = "RATE_LIMITED"
TOO_MANY_PENDING = "TOO_MANY_PENDING_TASKS"


def rate_limited(per_minute: int, retry_after: float) -> errors.ApiError:
    """RESOURCE_EXHAUSTED with RetryInfo for a tenant whose minute window is full."""
    telemetry.SUBMIT_REJECTIONS.labels(RATE_LIMITED).inc()
    return errors.resource_exhausted(
        RATE_LIMITED,
        f"more than {per_minute} submissions this minute",
        retry_after=max(retry_after, 0.001),
        limit=str(per_minute),
    )


def too_many_pending(limit: int) -> errors.ApiError:
    """RESOURCE_EXHAUSTED for a tenant already holding `limit` unfinished tasks."""
    telemetry.SUBMIT_REJECTIONS.labels(TOO_MANY_PENDING).inc()
    return errors.resource_exhausted(
        TOO_MANY_PENDING, f"at most {limit} unfinished tasks per tenant; wait for one to finish", limit=str(limit)
    )
