"""Per-tenant submission limits that hold across every submit replica, kept in PostgreSQL."""

from __future__ import annotations

from taskgate import errors, telemetry
from taskgate.store.submissions import GPU_SECONDS, TOKENS, Budget
from taskgate_api import reasons

# Which limit refused a submission (ErrorInfo metadata `scope`): the end user's own, or its tenant's in all.
END_USER = "end_user"
TENANT = "tenant"


def rate_limited(per_minute: int, retry_after: float, scope: str = TENANT) -> errors.ApiError:
    """RESOURCE_EXHAUSTED with RetryInfo for an end user's or a tenant's full minute window (ErrorInfo metadata
    `scope`: which one, `limit`: its allowance)."""
    telemetry.SUBMIT_REJECTIONS.labels(reasons.RATE_LIMITED).inc()
    whose = "per end user" if scope == END_USER else "for this tenant"
    return errors.resource_exhausted(
        reasons.RATE_LIMITED,
        f"more than {per_minute} submissions this minute {whose}",
        retry_after=max(retry_after, 0.001),
        limit=str(per_minute),
        scope=scope,
    )


def quota_exceeded(budget: Budget, retry_after: float) -> errors.ApiError:
    """RESOURCE_EXHAUSTED with RetryInfo (until the window resets) for a submission whose estimate does not fit what
    is left of the tenant's budget (ErrorInfo metadata `budget`: which one, 'gpu_seconds' or 'tokens')."""
    telemetry.SUBMIT_REJECTIONS.labels(reasons.QUOTA_EXCEEDED).inc()
    if budget.unit == TOKENS:
        return errors.resource_exhausted(
            reasons.QUOTA_EXCEEDED,
            f"this task reserves {budget.estimate:.0f} tokens (its max_output_tokens and its input) and the tenant's "
            f"token budget has {budget.left:.0f} left this {budget.window} (UTC)",
            retry_after=retry_after,
            budget=TOKENS,
            window=budget.window,
            tokens_left=f"{budget.left:.0f}",
            tokens_estimate=f"{budget.estimate:.0f}",
        )
    return errors.resource_exhausted(
        reasons.QUOTA_EXCEEDED,
        f"this task is estimated at {budget.estimate:.1f} GPU-seconds and the tenant's budget has "
        f"{budget.left:.1f} left this {budget.window} (UTC)",
        retry_after=retry_after,
        budget=GPU_SECONDS,
        window=budget.window,
        gpu_seconds_left=f"{budget.left:.3f}",
        gpu_seconds_estimate=f"{budget.estimate:.3f}",
    )


def too_many_pending(limit: int, scope: str = TENANT) -> errors.ApiError:
    """RESOURCE_EXHAUSTED for an end user (scope 'end_user') or a tenant (scope 'tenant') already holding `limit`
    unfinished tasks. No RetryInfo: when a place frees depends on a task finishing, which no clock says."""
    telemetry.SUBMIT_REJECTIONS.labels(reasons.TOO_MANY_PENDING_TASKS).inc()
    whose = "per end user" if scope == END_USER else "per tenant"
    return errors.resource_exhausted(
        reasons.TOO_MANY_PENDING_TASKS, f"at most {limit} unfinished tasks {whose}; wait for one to finish",
        limit=str(limit), scope=scope,
    )
