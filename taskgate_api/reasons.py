"""The reason codes of taskgate's errors: `google.rpc.ErrorInfo.reason` (in `DOMAIN`) on every error the services
send, and `TaskgateError.reason` in the SDK. One name each, written here only: the server raises them, the SDK's fake
(taskgate_client.testing) answers the same, and clients may match on them; each constant is its own value."""

from __future__ import annotations

from typing import Final

DOMAIN: Final = "taskgate.dev"  # ErrorInfo.domain

# any call
UNAUTHENTICATED: Final = "UNAUTHENTICATED"  # missing, unknown, revoked or expired key
PERMISSION_DENIED: Final = "PERMISSION_DENIED"  # the key may not make this call
NOT_FOUND: Final = "NOT_FOUND"  # no such task (or not the caller's)
BACKEND_UNAVAILABLE: Final = "BACKEND_UNAVAILABLE"  # the database or NATS is down: retry after RetryInfo
CONFLICT: Final = "CONFLICT"  # ABORTED: a concurrent write conflicted; the same request again gets past it
INTERNAL: Final = "INTERNAL"
TENANT_RATE_LIMITED: Final = "TENANT_RATE_LIMITED"  # more calls per second than the tenant's bucket holds
TOO_MANY_STREAMS: Final = "TOO_MANY_STREAMS"  # the tenant's or the server's open streams are at their limit

# admin keys (TaskAdmin) and tenant keys (TaskGateway)
ADMIN_SCOPE: Final = "ADMIN_SCOPE"  # a read-only admin key on an operator call
NOT_AN_ADMIN_KEY: Final = "NOT_AN_ADMIN_KEY"  # a tenant key on TaskAdmin
ADMIN_KEY_NOT_ACCEPTED: Final = "ADMIN_KEY_NOT_ACCEPTED"  # an admin key on TaskGateway
CLIENT_TOKEN_NOT_ACCEPTED: Final = "CLIENT_TOKEN_NOT_ACCEPTED"  # a client token on a call only an API key may make
CLIENT_TOKEN_SCOPE: Final = "CLIENT_TOKEN_SCOPE"  # a client token without the scope a call needs (read, watch, cancel)

# submitting
RATE_LIMITED: Final = "RATE_LIMITED"  # the tenant's submissions per minute (RetryInfo)
TOO_MANY_PENDING_TASKS: Final = "TOO_MANY_PENDING_TASKS"  # the tenant's unfinished-task limit (metadata limit)
# the task's GPU-seconds or tokens do not fit the tenant's budget (metadata budget; RetryInfo)
QUOTA_EXCEEDED: Final = "QUOTA_EXCEEDED"
IDEMPOTENCY_KEY_REUSED: Final = "IDEMPOTENCY_KEY_REUSED"  # ALREADY_EXISTS: the key names a different request (task_id)
PRIORITY_NOT_ALLOWED: Final = "PRIORITY_NOT_ALLOWED"  # above the tenant's highest priority

# a task's state
TASK_FINISHED: Final = "TASK_FINISHED"  # cancel of a finished task (metadata status)
TASK_NOT_FINISHED: Final = "TASK_NOT_FINISHED"  # regenerate of an unfinished task (metadata status)
TASK_NOT_SUCCEEDED: Final = "TASK_NOT_SUCCEEDED"  # a result of a task that did not succeed (metadata status)

# event streams (TaskEvents)
SUBSCRIBER_TOO_SLOW: Final = "SUBSCRIBER_TOO_SLOW"  # the stream fell too far behind and was closed: resume it
NOTIFIER_SHUTTING_DOWN: Final = "NOTIFIER_SHUTTING_DOWN"  # the notifier is draining: resume on another
STREAM_MAX_AGE: Final = "STREAM_MAX_AGE"  # UNAVAILABLE: the stream reached its maximum age: resume (a new connection)

# the SDK itself
CHECKSUM_MISMATCH: Final = "CHECKSUM_MISMATCH"  # DATA_LOSS: a download did not match the task's recorded sha256
