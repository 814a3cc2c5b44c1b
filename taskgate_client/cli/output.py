"""What the `taskgate` command prints: tasks, events, errors with their hints, a rotated secret; the shared
`--json` / table conventions are taskgate_api.cli's Output."""

from __future__ import annotations

from typing import Any

import grpc

from taskgate_api._compat import UTC
from taskgate_api.cli import EXIT_BY_CODE, EXIT_ERROR, EXIT_OK, Output
from taskgate_api.v1 import admin_pb2, gateway_pb2, task_pb2
from taskgate_client import Status, Task, TaskEvent, TaskgateError

HINTS: dict[grpc.StatusCode, str] = {
    grpc.StatusCode.NOT_FOUND: "check the id with `taskgate list` (tasks are visible only to the tenant that submitted "
    "them)",
    grpc.StatusCode.INVALID_ARGUMENT: "fix the fields named above and submit again",
    grpc.StatusCode.UNAUTHENTICATED: "pass --api-key or set TASKGATE_API_KEY (`make run` saves a demo key in "
    ".taskgate/client.json)",
    grpc.StatusCode.PERMISSION_DENIED: "use an admin key: --admin-key or TASKGATE_ADMIN_KEY (`taskgate-keys create "
    "--tenant ops --admin`)",
    grpc.StatusCode.FAILED_PRECONDITION: "check the task's status with `taskgate get ID`",
    grpc.StatusCode.ALREADY_EXISTS: "this idempotency key was used for a different request; use a new key",
    grpc.StatusCode.UNAVAILABLE: "is the stack running? start it with `make run`, or pass --address; then retry",
    grpc.StatusCode.DEADLINE_EXCEEDED: "the call took too long; retry, or raise --timeout",
    grpc.StatusCode.DATA_LOSS: "the download did not match the recorded checksum; download again",
}


def short(text: str, width: int = 48) -> str:
    return text if len(text) <= width else text[: width - 1] + "…"


def status_name(value: int) -> str:
    return task_pb2.TaskStatus.Name(value).removeprefix("TASK_STATUS_")  # type: ignore[arg-type]


def callback_name(value: int) -> str:
    return task_pb2.CallbackStatus.Name(value).removeprefix("CALLBACK_STATUS_")  # type: ignore[arg-type]


def print_task(out: Output, task: Task) -> None:
    """A task as key/value lines (or its JSON document)."""
    if out.json:
        out.document(task.to_dict())
        return
    result = task.result
    out.fields(
        [
            ("task_id", task.task_id),
            ("status", task.status),
            ("progress", f"{task.progress}%"),
            ("queue position", task.queue_position or ""),
            ("estimated start", task.estimated_start or ""),
            ("estimated finish", task.estimated_finish or ""),
            ("model", task.model_id),
            ("task type", task.task_type if task.image is not None else ""),
            (
                "image",
                f"{task.image.width}x{task.image.height}, sha256 {task.image.sha256[:16]}…" if task.image else "",
            ),
            ("prompt", short(task.prompt, 80)),
            ("end user", task.end_user),
            ("priority", task.priority),
            ("attempt", task.attempt or ""),
            ("created", task.created_at),
            ("finished", task.finished_at),
            ("error", f"{task.error_code}: {task.error_message}" if task.error_code else ""),
            ("result", f"{result.size_bytes} bytes, sha256 {result.sha256[:16]}…" if result else ""),
            ("reused", "yes (identical earlier run)" if task.result_reused else ""),
            ("replay of", task.replay_of or ""),
            ("callback", f"{task.callback_url} ({task.callback_status})" if task.callback_url else ""),
            (
                "new",
                ""
                if task.created is None
                else ("yes" if task.created else "no, existing task for this idempotency key"),
            ),
        ]
    )


def print_event(out: Output, event: TaskEvent) -> None:
    """One line per watched event, each with its version."""
    if out.json:
        out.document(event.to_dict())
        return
    move = (
        f"{event.from_status.value} → {event.status.value}" if event.from_status else f"{event.status.value} (snapshot)"
    )
    at = event.at.astimezone().strftime("%H:%M:%S.%f")[:-3] if event.at else ""
    extra = []
    if event.status is Status.PROCESSING or event.progress:
        extra.append(f"{event.progress}%")
    if event.queue_position:
        extra.append(f"queue position {event.queue_position}")
    if event.error_code:
        extra.append(f"{event.error_code}: {event.error_message}")
    if event.reason:
        extra.append(f"({event.reason})")
    out.line(f"v{event.version:<4} {at}  {move:<26} {' '.join(extra)}".rstrip())


def report_error(out: Output, exc: TaskgateError, *, admin: bool = False) -> int:
    """Prints one line naming the status code, with the reason and a hint; returns the exit code."""
    reason = f" [{exc.reason}]" if exc.reason and exc.reason != exc.code_name else ""
    missing = [f"{v.field}: {v.description}" for v in exc.field_violations]
    fields = "".join(f"; {text}" for text in dict.fromkeys(missing) if text not in exc.message)
    retry = (
        f"; retry in {exc.retry_delay:g}s" if exc.retry_delay and exc.code is grpc.StatusCode.RESOURCE_EXHAUSTED else ""
    )
    hint = HINTS.get(exc.code, "")
    if exc.code is grpc.StatusCode.RESOURCE_EXHAUSTED:
        hint = "wait for some of your tasks to finish, or retry later"
    elif admin and exc.code is grpc.StatusCode.UNAUTHENTICATED:
        hint = "pass --admin-key or set TASKGATE_ADMIN_KEY (`make run` saves one in .taskgate/client.json)"
    out.err.write(
        f"error: {exc.code_name}: {exc.message}{reason}{fields}{retry}" + (f" — hint: {hint}" if hint else "") + "\n"
    )
    if out.json:
        out.document({"error": {**exc.to_dict(), "hint": hint}})
    return EXIT_BY_CODE.get(exc.code, EXIT_ERROR)


def timestamp_text(ts: Any) -> str:
    return str(ts.ToDatetime(tzinfo=UTC).astimezone().strftime("%Y-%m-%d %H:%M:%S"))


def duration_seconds(d: Any) -> float:
    return float(d.ToNanoseconds()) / 1e9


def print_rotated(
    done: admin_pb2.RotateWebhookSecretResponse | gateway_pb2.TaskGatewayRotateWebhookSecretResponse,
    tenant: str | None,
    out: Output,
) -> int:
    who = [("tenant", tenant)] if tenant is not None else []
    if out.json:
        until = done.previous_valid_until.ToDatetime(tzinfo=UTC).isoformat()
        out.document({**dict(who), "webhook_secret": done.webhook_secret, "previous_valid_until": until,
                      "valid_secrets": done.valid_secrets})
        return EXIT_OK
    out.fields([*who, ("webhook secret", done.webhook_secret),
                ("previous valid until", timestamp_text(done.previous_valid_until)),
                ("secrets signing now", done.valid_secrets)])
    out.line(
        "\nStore the new secret now: it is not shown again. Receivers accept either secret until the overlap ends."
    )
    return EXIT_OK
