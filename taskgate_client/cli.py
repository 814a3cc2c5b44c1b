"""`taskgate`: submit, follow and manage tasks from a shell; defaults to the stack `make run` started.

Exit codes (a contract for scripts):
  0 success                 1 other error (INTERNAL, UNKNOWN, ...)      2 usage error
  3 NOT_FOUND               4 INVALID_ARGUMENT                          5 RESOURCE_EXHAUSTED
  6 UNAUTHENTICATED         7 PERMISSION_DENIED                         8 FAILED_PRECONDITION
  9 ALREADY_EXISTS          10 UNAVAILABLE (service or database down)   11 DEADLINE_EXCEEDED / --wait timed out
  12 DATA_LOSS (download checksum mismatch)
  20 task FAILED            21 task TIMEOUT                              22 task CANCELED   (submit --wait, wait)
  130 interrupted (Ctrl-C)
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import os
import sys
from collections.abc import Callable, Sequence
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any, TextIO

import grpc
from google.protobuf import json_format
from google.protobuf.message import Message

from taskgate.v1 import admin_pb2, gateway_pb2, task_pb2
from taskgate_client import (
    AsyncTaskgateClient,
    Status,
    SubmitItem,
    Task,
    TaskEvent,
    TaskgateError,
    WaitTimeout,
    make_config,
)
from taskgate_client._compat import UTC
from taskgate_client.config import DEFAULT_ADDRESS, ClientConfig
from taskgate_client.local import LocalStack, find_state_dir
from taskgate_client.progress import follow
from taskgate_client.repair import repair
from taskgate_client.version import __version__

EXIT_OK = 0
EXIT_ERROR = 1
EXIT_USAGE = 2
EXIT_UNAVAILABLE = 10
EXIT_TIMEOUT = 11
EXIT_SKIPPED = 13  # admin requeue: some task was neither requeued nor replayed (each item's detail says why)
EXIT_INTERRUPTED = 130
EXIT_BY_CODE: dict[grpc.StatusCode, int] = {
    grpc.StatusCode.NOT_FOUND: 3,
    grpc.StatusCode.INVALID_ARGUMENT: 4,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 5,
    grpc.StatusCode.UNAUTHENTICATED: 6,
    grpc.StatusCode.PERMISSION_DENIED: 7,
    grpc.StatusCode.FAILED_PRECONDITION: 8,
    grpc.StatusCode.ALREADY_EXISTS: 9,
    grpc.StatusCode.UNAVAILABLE: EXIT_UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED: EXIT_TIMEOUT,
    grpc.StatusCode.DATA_LOSS: 12,
}
EXIT_BY_STATUS: dict[Status, int] = {Status.SUCCEEDED: 0, Status.FAILED: 20, Status.TIMEOUT: 21, Status.CANCELED: 22}

HINTS: dict[grpc.StatusCode, str] = {
    grpc.StatusCode.NOT_FOUND: "check the id with `taskgate list` (tasks are visible only to the tenant that submitted them)",
    grpc.StatusCode.INVALID_ARGUMENT: "fix the fields named above and submit again",
    grpc.StatusCode.UNAUTHENTICATED: "pass --api-key or set TASKGATE_API_KEY (`make run` saves a demo key in .taskgate/client.json)",
    grpc.StatusCode.PERMISSION_DENIED: "use an admin key: --admin-key or TASKGATE_ADMIN_KEY (`taskgate-keys create --tenant ops --admin`)",
    grpc.StatusCode.FAILED_PRECONDITION: "check the task's status with `taskgate get ID`",
    grpc.StatusCode.ALREADY_EXISTS: "this idempotency key was used for a different request; use a new key",
    grpc.StatusCode.UNAVAILABLE: "is the stack running? start it with `make run`, or pass --address; then retry",
    grpc.StatusCode.DEADLINE_EXCEEDED: "the call took too long; retry, or raise --timeout",
    grpc.StatusCode.DATA_LOSS: "the download did not match the recorded checksum; download again",
}


class CliError(Exception):
    """A failure outside gRPC (usage, configuration) with the exit code to use."""

    def __init__(self, message: str, exit_code: int = EXIT_ERROR, hint: str = "") -> None:
        super().__init__(message)
        self.exit_code = exit_code
        self.hint = hint


# -- output -------------------------------------------------------------------------------------------------------


class Output:
    """Where results go: one JSON document (or JSON lines for streams) with --json, readable text otherwise."""

    def __init__(self, as_json: bool, out: TextIO = sys.stdout, err: TextIO = sys.stderr) -> None:
        self.json = as_json
        self.out = out
        self.err = err

    def document(self, data: object) -> None:
        self.out.write(json.dumps(data, default=_json_default) + "\n")
        self.out.flush()

    def line(self, text: str = "") -> None:
        self.out.write(text + "\n")
        self.out.flush()

    def table(self, headers: Sequence[str], rows: Sequence[Sequence[object]]) -> None:
        cells = [[str(c) for c in headers], *[[_cell(c) for c in row] for row in rows]]
        widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
        for row in cells:
            self.line("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip())

    def listing(
        self, key: str, items: Sequence[Message], empty: str, headers: Sequence[str], row: Callable[[Any], Sequence[object]]
    ) -> int:
        """A list of messages: `{key: [...]}` with --json, else a table (or `empty` when there is nothing)."""
        if self.json:
            self.document({key: [_proto_dict(item) for item in items]})
        elif not items:
            self.line(empty)
        else:
            self.table(headers, [row(item) for item in items])
        return EXIT_OK

    def fields(self, pairs: Sequence[tuple[str, object]]) -> None:
        width = max(len(k) for k, _ in pairs)
        for key, value in pairs:
            if value not in (None, ""):
                self.line(f"{key.ljust(width)}  {_cell(value)}")


def _json_default(value: object) -> object:
    if isinstance(value, datetime):
        return value.isoformat()
    if isinstance(value, Message):
        return _proto_dict(value)
    raise TypeError(f"not JSON serialisable: {type(value).__name__}")


def _proto_dict(msg: Message) -> dict[str, Any]:
    return json_format.MessageToDict(msg, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)


def _cell(value: object) -> str:
    if isinstance(value, datetime):
        return value.astimezone().strftime("%Y-%m-%d %H:%M:%S")
    if isinstance(value, Status):
        return value.value
    return str(value)


def _short(text: str, width: int = 48) -> str:
    return text if len(text) <= width else text[: width - 1] + "…"


def _status_name(value: int) -> str:
    return task_pb2.TaskStatus.Name(value).removeprefix("TASK_STATUS_")  # type: ignore[arg-type]


def _callback_name(value: int) -> str:
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
            ("image", f"{task.image.width}x{task.image.height}, sha256 {task.image.sha256[:16]}…" if task.image else ""),
            ("prompt", _short(task.prompt, 80)),
            ("priority", task.priority),
            ("attempt", task.attempt or ""),
            ("created", task.created_at),
            ("finished", task.finished_at),
            ("error", f"{task.error_code}: {task.error_message}" if task.error_code else ""),
            ("result", f"{result.size_bytes} bytes, sha256 {result.sha256[:16]}…" if result else ""),
            ("reused", "yes (identical earlier run)" if task.result_reused else ""),
            ("replay of", task.replay_of or ""),
            ("callback", f"{task.callback_url} ({task.callback_status})" if task.callback_url else ""),
            ("new", "" if task.created is None else ("yes" if task.created else "no, existing task for this idempotency key")),
        ]
    )


def print_event(out: Output, event: TaskEvent) -> None:
    """One line per watched event, each with its version."""
    if out.json:
        out.document(event.to_dict())
        return
    move = f"{event.from_status.value} → {event.status.value}" if event.from_status else f"{event.status.value} (snapshot)"
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
    retry = f"; retry in {exc.retry_delay:g}s" if exc.retry_delay and exc.code is grpc.StatusCode.RESOURCE_EXHAUSTED else ""
    hint = HINTS.get(exc.code, "")
    if exc.code is grpc.StatusCode.RESOURCE_EXHAUSTED:
        hint = "wait for some of your tasks to finish, or retry later"
    elif admin and exc.code is grpc.StatusCode.UNAUTHENTICATED:
        hint = "pass --admin-key or set TASKGATE_ADMIN_KEY (`make run` saves one in .taskgate/client.json)"
    out.err.write(f"error: {exc.code_name}: {exc.message}{reason}{fields}{retry}" + (f" — hint: {hint}" if hint else "") + "\n")
    if out.json:
        out.document({"error": {**exc.to_dict(), "hint": hint}})
    return EXIT_BY_CODE.get(exc.code, EXIT_ERROR)


def report_cli_error(out: Output, exc: CliError) -> int:
    """Prints one line with the message and its hint; returns the exit code."""
    out.err.write(f"error: {exc}" + (f" — hint: {exc.hint}" if exc.hint else "") + "\n")
    if out.json:
        out.document({"error": {"code": "CLI", "message": str(exc), "hint": exc.hint}})
    return exc.exit_code


# -- connection ---------------------------------------------------------------------------------------------------


def _state_dir() -> Path:
    return find_state_dir(Path(_env("TASKGATE_STATE_DIR") or ".taskgate"))


def _env(name: str) -> str | None:
    return os.environ.get(name) or None


def client_config(args: argparse.Namespace) -> ClientConfig:
    """Flags win, then TASKGATE_* variables, then the details `make run` saved, then localhost defaults."""
    saved = LocalStack.load(_state_dir())
    address = args.address or _env("TASKGATE_ADDRESS")
    use_saved = address is None and saved is not None
    if address is None:
        address = saved.address if saved is not None else DEFAULT_ADDRESS
    return make_config(
        address,
        args.api_key or _env("TASKGATE_API_KEY") or (saved.api_key if saved else None),
        events_address=args.events_address or _env("TASKGATE_EVENTS_ADDRESS") or (saved.events_address if use_saved and saved else None),
        admin_address=args.admin_address or _env("TASKGATE_ADMIN_ADDRESS") or (saved.admin_address if use_saved and saved else None),
        admin_key=args.admin_key or _env("TASKGATE_ADMIN_KEY") or (saved.admin_key if saved else None),
        tls=args.tls,
        root_certificates=args.tls_ca,
        client_cert=args.tls_cert,
        client_key=args.tls_key,
        tls_server_name=args.tls_server_name,
        call_timeout=args.timeout,
    )


# -- task commands ------------------------------------------------------------------------------------------------


def _metadata(items: list[str]) -> dict[str, str]:
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise CliError(f"--metadata wants KEY=VALUE, not {item!r}", EXIT_USAGE)
        out[key] = value
    return out


async def _finish(client: AsyncTaskgateClient, out: Output, task: Task, wait_seconds: float | None) -> int:
    # The bar goes to stderr so stdout stays one document; off when stderr is not a terminal and --json is set.
    progress_out: TextIO = out.err if (out.err.isatty() or not out.json) else io.StringIO()
    final = await follow(client, task.task_id, progress_out, wait_seconds)
    print_task(out, final)
    return EXIT_BY_STATUS.get(final.status, EXIT_ERROR)


SUBMIT_ITEM_KEYS = SubmitItem.__required_keys__ | SubmitItem.__optional_keys__


def _submit_items(path: str) -> list[SubmitItem]:
    """The tasks of a JSON-lines file (`-` for stdin): one object per line with submit_many's keys."""
    try:
        text = sys.stdin.read() if path == "-" else Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise CliError(f"cannot read {path}: {exc.strerror}", EXIT_USAGE) from None
    items: list[SubmitItem] = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except ValueError as exc:
            raise CliError(f"{path}:{number}: not JSON ({exc})", EXIT_USAGE) from None
        if not isinstance(item, dict):
            raise CliError(f"{path}:{number}: want a JSON object", EXIT_USAGE)
        unknown = sorted(set(item) - SUBMIT_ITEM_KEYS)
        if unknown:
            raise CliError(f"{path}:{number}: unknown key {unknown[0]!r}; known: {', '.join(sorted(SUBMIT_ITEM_KEYS))}",
                           EXIT_USAGE)
        items.append(item)  # type: ignore[arg-type]  # its keys are checked; the gateway checks the values
    return items


async def cmd_submit_file(client: AsyncTaskgateClient, args: argparse.Namespace, out: Output) -> int:
    """`submit --file`: SubmitTasks in chunks; one line (or JSON line) per task, in file order."""
    items = _submit_items(args.file)
    progress_out: TextIO = out.err if (out.err.isatty() or not out.json) else io.StringIO()

    def progress(done: int, total: int) -> None:
        filled = 30 * done // max(total, 1)
        end = "\n" if done == total else ""
        progress_out.write(f"\rsubmitting [{'#' * filled}{'.' * (30 - filled)}] {done}/{total}{end}")
        progress_out.flush()

    results = await client.submit_many(items, on_progress=progress) if items else []
    failed = 0
    for index, result in enumerate(results):
        if isinstance(result, TaskgateError):
            failed += 1
            if out.json:
                out.document({"index": index, "error": result.to_dict()})
            else:
                out.line(f"{index}\t{result.code_name}\t{result.message}")
        elif out.json:
            out.document({"index": index, "task": result.to_dict()})
        else:
            created = "created" if result.created else "existing"
            out.line(f"{index}\t{result.task_id}\t{result.status.value}\t{created}")
    if failed and not out.json:
        out.err.write(f"{failed} of {len(results)} refused\n")
    return EXIT_ERROR if failed else EXIT_OK


def _image_arg(value: str | None) -> str | None:
    """An image argument as the SDK takes it: an https URL as it is, a file that must exist."""
    if value is None or value.startswith(("https://", "http://")):
        return value
    if not os.path.isfile(value):
        raise CliError(f"no such image file: {value}", EXIT_USAGE)
    return value


async def cmd_upload(client: AsyncTaskgateClient, args: argparse.Namespace, out: Output) -> int:
    image = await client.upload_input(_image_arg(args.file) or args.file)
    if out.json:
        out.document({**image.to_dict(), "source_format": image.source_format})
    else:
        out.line(f"{image.sha256}\t{image.width}x{image.height}\t{image.size_bytes} bytes (sent as {image.source_format})")
    return EXIT_OK


async def cmd_submit(client: AsyncTaskgateClient, args: argparse.Namespace, out: Output) -> int:
    if args.file is not None:
        if args.prompt is not None:
            raise CliError("give a prompt or --file, not both", EXIT_USAGE)
        return await cmd_submit_file(client, args, out)
    if args.prompt is None:
        raise CliError("give a prompt (or --file tasks.jsonl)", EXIT_USAGE)
    image = _image_arg(args.image)
    task = await client.submit(
        args.prompt,
        args.model,
        frames=args.frames,
        width=args.width,
        height=args.height,
        steps=args.steps,
        guidance=args.guidance,
        fps=args.fps,
        seed=args.seed,
        negative_prompt=args.negative_prompt,
        priority=args.priority,
        idempotency_key=args.idempotency_key,
        callback_url=args.callback_url,
        callback_events=args.callback_event,
        metadata=_metadata(args.metadata),
        max_retries=args.max_retries,
        task_type=args.task_type,
        image=image,
        start_after=args.start_after,
        max_queue_seconds=args.max_queue_seconds,
    )
    if not args.wait:
        print_task(out, task)
        return EXIT_OK
    if not out.json:
        out.err.write(f"submitted {task.task_id}\n")
    return await _finish(client, out, task, args.wait_timeout)


async def cmd_wait(client: AsyncTaskgateClient, args: argparse.Namespace, out: Output) -> int:
    return await _finish(client, out, await client.get(args.task_id), args.wait_timeout)


async def cmd_get(client: AsyncTaskgateClient, args: argparse.Namespace, out: Output) -> int:
    print_task(out, await client.get(args.task_id))
    return EXIT_OK


async def cmd_list(client: AsyncTaskgateClient, args: argparse.Namespace, out: Output) -> int:
    statuses = [s.strip() for item in args.status for s in item.split(",") if s.strip()] or None
    if statuses:
        bad = [s for s in statuses if s.upper() not in Status.__members__]
        if bad:
            raise CliError(f"unknown status {bad[0]!r}; one of {', '.join(Status)}", EXIT_USAGE)
    tasks: list[Task] = []
    async for task in client.list(statuses, page_size=min(args.limit, 100)):
        tasks.append(task)
        if len(tasks) >= args.limit:
            break
    if out.json:
        out.document({"tasks": [t.to_dict() for t in tasks]})
        return EXIT_OK
    if not tasks:
        out.line("no tasks")
        return EXIT_OK
    out.table(
        ["TASK ID", "STATUS", "PROGRESS", "MODEL", "CREATED", "PROMPT"],
        [[t.task_id, t.status, f"{t.progress}%", t.model_id, t.created_at or "", _short(t.prompt, 40)] for t in tasks],
    )
    return EXIT_OK


async def cmd_watch(client: AsyncTaskgateClient, args: argparse.Namespace, out: Output) -> int:
    async for event in client.watch(args.task_id, after_version=args.after_version):
        print_event(out, event)
    return EXIT_OK


async def cmd_cancel(client: AsyncTaskgateClient, args: argparse.Namespace, out: Output) -> int:
    print_task(out, await client.cancel(args.task_id, hard=args.hard))
    return EXIT_OK


async def cmd_regenerate(client: AsyncTaskgateClient, args: argparse.Namespace, out: Output) -> int:
    task = await client.regenerate(args.task_id, seed=args.seed)
    if not args.wait:
        print_task(out, task)
        return EXIT_OK
    if not out.json:
        out.err.write(f"submitted {task.task_id}\n")
    return await _finish(client, out, task, args.wait_timeout)


async def cmd_result(client: AsyncTaskgateClient, args: argparse.Namespace, out: Output) -> int:
    path = Path(args.output or f"{args.task_id}.mp4")
    info = await client.download(args.task_id, path)
    if out.json:
        out.document({"task_id": args.task_id, "path": str(path), **info.to_dict()})
    else:
        out.line(f"wrote {path} ({info.size_bytes} bytes, {info.content_type}, sha256 {info.sha256} verified)")
    return EXIT_OK


# -- admin commands -----------------------------------------------------------------------------------------------


def _ts(ts: Any) -> str:
    return str(ts.ToDatetime(tzinfo=UTC).astimezone().strftime("%Y-%m-%d %H:%M:%S"))


def _seconds(d: Any) -> float:
    return float(d.ToNanoseconds()) / 1e9


async def cmd_admin_stats(client: AsyncTaskgateClient, args: argparse.Namespace, out: Output) -> int:
    stats = await client.stats()
    if out.json:
        out.document(_proto_dict(stats))
        return EXIT_OK
    out.table(["MODEL", "STATUS", "COUNT"], [[c.model_id, _status_name(c.status), c.count] for c in stats.counts] or [["-", "-", 0]])
    if stats.HasField("oldest_queued_age"):
        out.line(f"\noldest queued task: {_seconds(stats.oldest_queued_age):.1f}s")
    out.line(f"running: {stats.running} of {stats.capacity} slots (the live workers'; beyond them tasks wait QUEUED)")
    if stats.workers:
        out.line()
        out.table(
            ["WORKER", "RUNNING", "SLOTS", "ALIVE", "LAST HEARTBEAT"],
            [
                [w.worker_id, w.running, w.slots, "yes" if w.alive else "no", _ts(w.last_heartbeat)]
                for w in stats.workers
            ],
        )
    if stats.callbacks:
        out.line()
        out.table(
            ["CALLBACKS", "COUNT"],
            [[_callback_name(c.status), c.count] for c in stats.callbacks],
        )
    return EXIT_OK


async def cmd_admin_stuck(client: AsyncTaskgateClient, args: argparse.Namespace, out: Output) -> int:
    return out.listing(
        "tasks",
        await client.stuck(args.limit),
        "no stuck tasks",
        ["TASK ID", "STATUS", "MODEL", "ATTEMPT", "REASON"],
        lambda s: [s.task.id, _status_name(s.task.status), s.task.model_id, s.task.attempt, s.reason],
    )


def _print_batch(out: Output, batch: admin_pb2.RequeueBatch) -> None:
    if out.json:
        out.document(_proto_dict(batch))
        return
    label = " (dry run)" if batch.dry_run else ""
    out.line(f"batch {batch.batch}{label}: {len(batch.items)} task(s)")
    for item in batch.items:
        out.line(f"  {item.task_id}  {_status_name(item.from_status):<10} {item.action:<14} {item.detail}".rstrip())


async def cmd_admin_requeue(client: AsyncTaskgateClient, args: argparse.Namespace, out: Output) -> int:
    """Prints each batch; exits EXIT_SKIPPED when any task was skipped, so a script sees what was left undone."""
    if not args.task_ids and not args.status and not args.model:
        raise CliError("give task ids, or a filter (--status/--model/--older-than)", EXIT_USAGE)
    total = skipped = 0
    async for batch in client.requeue(
        args.task_ids,
        status=args.status or None,
        model=args.model,
        older_than=args.older_than,
        dry_run=args.dry_run,
        batch_size=args.batch_size,
        reason=args.reason,
        replay_finished=args.replay_finished,
    ):
        _print_batch(out, batch)
        total += len(batch.items)
        skipped += sum(1 for item in batch.items if item.action == "SKIPPED")
    if not skipped:
        return EXIT_OK
    hint = "each item's detail says why"
    if not args.replay_finished:
        hint += "; --replay-finished replays FAILED and TIMEOUT tasks as new tasks"
    out.err.write(f"error: SKIPPED: {skipped} of {total} task(s) neither requeued nor replayed — hint: {hint}\n")
    return EXIT_SKIPPED


async def cmd_admin_repair(client: AsyncTaskgateClient, args: argparse.Namespace, out: Output) -> int:
    report = io.StringIO() if out.json else out.out
    result = await repair(
        client.admin_stub,
        args.dry_run,
        args.batch_size,
        report,
        metadata=client.admin_metadata,
        call_timeout=client.config.call_timeout,
    )
    if out.json:
        summary = {"stuck": result.stuck, "batches": result.batches, "outcomes": dict(result.outcomes), "error": result.error}
        out.document({**summary, "dry_run": args.dry_run})
    if result.error is None:
        return EXIT_OK
    code_name = result.error.split(":", 1)[0]
    code = grpc.StatusCode.__members__.get(code_name)
    return EXIT_BY_CODE.get(code, EXIT_ERROR) if code is not None else EXIT_ERROR


async def cmd_admin_dead_letters(client: AsyncTaskgateClient, args: argparse.Namespace, out: Output) -> int:
    letters = []
    async for letter in client.dead_letters(page_size=min(args.limit, 100)):
        letters.append(letter)
        if len(letters) >= args.limit:
            break
    return out.listing(
        "dead_letters",
        letters,
        "no dead letters",
        ["TASK ID", "STATUS", "MODEL", "DEAD AT", "REASON", "REPLAYED AS"],
        lambda d: [
            d.task.id, _status_name(d.task.status), d.task.model_id, _ts(d.dead_at), _short(d.reason, 60), d.replayed_as,
        ],
    )


async def cmd_admin_redeliver(client: AsyncTaskgateClient, args: argparse.Namespace, out: Output) -> int:
    return out.listing(
        "deliveries",
        await client.redeliver(args.task_id),
        "nothing to redeliver",
        ["DELIVERY", "WEBHOOK ID", "EVENT", "STATUS", "ATTEMPTS"],
        lambda d: [d.delivery_id, d.webhook_id, d.event, _callback_name(d.status), d.attempts],
    )


AGE_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def _age(text: str) -> float:
    """A cut-off age: seconds, or a number with s, m, h or d (`30d`, `12h`)."""
    unit = AGE_UNITS.get(text[-1:].lower())
    try:
        value = float(text[:-1] if unit else text) * (unit or 1)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an age such as 3600, 90m, 12h or 30d") from None
    if value < 0:
        raise argparse.ArgumentTypeError("an age is not negative")
    return value


def _start_time(text: str) -> datetime:
    """When to start: a delay from now (`90`, `10m`, `2h`) or an ISO 8601 time (`2026-12-24T18:00:00+01:00`)."""
    try:
        return datetime.now(UTC) + timedelta(seconds=_age(text))
    except argparse.ArgumentTypeError:
        pass
    try:
        moment = datetime.fromisoformat(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is neither a delay such as 10m nor an ISO 8601 time") from None
    return moment if moment.tzinfo else moment.astimezone()


async def cmd_admin_deliveries(client: AsyncTaskgateClient, args: argparse.Namespace, out: Output) -> int:
    found = []
    async for delivery in client.deliveries(args.status, page_size=min(args.limit, 100)):
        found.append(delivery)
        if len(found) >= args.limit:
            break
    return out.listing(
        "deliveries",
        found,
        "no deliveries",
        ["DELIVERY", "TASK ID", "TENANT", "EVENT", "STATUS", "ATTEMPTS", "LAST ERROR"],
        lambda d: [d.delivery_id, d.task_id, d.tenant, d.event, _callback_name(d.status), d.attempts,
                   _short(d.last_error or (f"HTTP {d.last_status_code}" if d.last_status_code else ""), 60)],
    )


async def cmd_admin_audit(client: AsyncTaskgateClient, args: argparse.Namespace, out: Output) -> int:
    found = []
    async for event in client.audit(args.by, page_size=min(args.limit, 100)):
        found.append(event)
        if len(found) >= args.limit:
            break
    return out.listing(
        "events",
        found,
        "no admin actions recorded",
        ["WHEN", "ADMIN", "KEY", "ACTION", "TARGET", "DRY RUN"],
        lambda e: [_ts(e.at), e.admin, e.prefix, e.action, e.target, "yes" if e.dry_run else ""],
    )


async def cmd_rotate_webhook_secret(client: AsyncTaskgateClient, args: argparse.Namespace, out: Output) -> int:
    done = await client.rotate_own_webhook_secret(overlap=args.overlap)
    return _rotated(done, None, out)


async def cmd_admin_rotate_secret(client: AsyncTaskgateClient, args: argparse.Namespace, out: Output) -> int:
    done = await client.rotate_webhook_secret(args.tenant, overlap=args.overlap)
    return _rotated(done, args.tenant, out)


def _rotated(
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
                ("previous valid until", _ts(done.previous_valid_until)),
                ("secrets signing now", done.valid_secrets)])
    out.line("\nStore the new secret now: it is not shown again. Receivers accept either secret until the overlap ends.")
    return EXIT_OK


async def cmd_admin_keys(client: AsyncTaskgateClient, args: argparse.Namespace, out: Output) -> int:
    return out.listing(
        "keys",
        await client.api_keys(args.tenant),
        "no keys",
        ["PREFIX", "TENANT/ADMIN", "ADMIN SCOPE", "CREATED", "EXPIRES", "REVOKED"],
        lambda k: [k.prefix, k.tenant, k.scope if k.admin else "", _ts(k.created_at),
                   _ts(k.expires_at) if k.HasField("expires_at") else "",
                   _ts(k.revoked_at) if k.HasField("revoked_at") else ""],
    )


async def cmd_admin_revoke_key(client: AsyncTaskgateClient, args: argparse.Namespace, out: Output) -> int:
    revoked = await client.revoke_api_keys(args.prefix)
    if out.json:
        out.document({"prefix": args.prefix, "revoked": revoked})
    else:
        out.line(f"revoked {revoked} key(s) with prefix {args.prefix}")
    return EXIT_OK


async def cmd_admin_usage(client: AsyncTaskgateClient, args: argparse.Namespace, out: Output) -> int:
    since = datetime.now(UTC) - timedelta(seconds=args.since)
    found = await client.usage(args.tenant, since=since, by_hour=args.by_hour)
    if out.json:
        out.document(_proto_dict(found))
        return EXIT_OK
    head = ["TENANT", "MODEL", *(["HOUR (UTC)"] if args.by_hour else []), "GPU-SECONDS", "SLOT SECONDS", "ATTEMPTS"]
    rows = [
        [u.tenant, u.model_id, *([u.hour.ToDatetime().strftime("%Y-%m-%d %H:00")] if args.by_hour else []),
         f"{u.gpu_seconds:.1f}", f"{u.slot_seconds:.1f}", u.attempts]
        for u in found.rows
    ]
    if not rows:
        out.line("no metered use in that range")
        return EXIT_OK
    out.table(head, rows)
    if found.truncated:
        out.line("\n(more rows matched: narrow --since or --tenant)")
    return EXIT_OK


async def cmd_admin_purge(client: AsyncTaskgateClient, args: argparse.Namespace, out: Output) -> int:
    done = await client.purge(args.older_than, dry_run=args.dry_run)
    kept = {k.reason: k.tasks for k in done.kept}
    if out.json:
        out.document({"tasks": done.tasks, "results": done.results, "reusable_results": done.reusable_results,
                      "dry_run": done.dry_run, "kept": kept})
        return EXIT_OK
    verb = "would delete" if done.dry_run else "deleted"
    out.line(f"{verb}: {done.tasks} finished task(s) with their history, {done.results} stored output(s), "
             f"{done.reusable_results} reusable output(s)")
    why = {"webhook_undelivered": "webhook not delivered yet", "attempt_running": "soft-cancelled, attempt still running"}
    for reason, n in kept.items():
        out.line(f"{'would keep' if done.dry_run else 'kept'}: {n} finished task(s) ({why.get(reason, reason)})")
    return EXIT_OK


# -- parser -------------------------------------------------------------------------------------------------------


def _common() -> argparse.ArgumentParser:
    """Options accepted before or after the command (defaults suppressed so the later position does not reset them)."""
    p = argparse.ArgumentParser(add_help=False)
    S = argparse.SUPPRESS
    p.add_argument("--json", action="store_true", default=S, help="machine-readable output (JSON; JSON lines for streams)")
    p.add_argument("--address", default=S, help="gateway host:port (env TASKGATE_ADDRESS; default: the `make run` stack)")
    p.add_argument("--api-key", default=S, help="API key (env TASKGATE_API_KEY; default: the `make run` demo key)")
    p.add_argument("--admin-key", default=S, help="admin key for `admin` commands (env TASKGATE_ADMIN_KEY)")
    p.add_argument("--events-address", default=S, help="notifier host:port (default: gateway host, port 50052)")
    p.add_argument("--admin-address", default=S, help="scheduler host:port (default: gateway host, port 50053)")
    p.add_argument("--tls", action="store_true", default=S, help="use TLS with the system's root certificates")
    p.add_argument("--tls-ca", default=S, metavar="PEM", help="CA certificate to trust (turns TLS on)")
    p.add_argument("--tls-cert", default=S, metavar="PEM", help="client certificate for mutual TLS")
    p.add_argument("--tls-key", default=S, metavar="PEM", help="client private key for mutual TLS")
    p.add_argument("--tls-server-name", default=S, help="expected server name in its certificate")
    p.add_argument("--timeout", type=float, default=S, help="seconds per call (default 30)")
    return p


DEFAULTS: dict[str, object] = {
    "json": False,
    "address": None,
    "api_key": None,
    "admin_key": None,
    "events_address": None,
    "admin_address": None,
    "tls": False,
    "tls_ca": None,
    "tls_cert": None,
    "tls_key": None,
    "tls_server_name": None,
    "timeout": 30.0,
}


def build_parser() -> argparse.ArgumentParser:
    """The whole command line."""
    common = _common()
    parser = argparse.ArgumentParser(
        prog="taskgate",
        parents=[common],
        description="Submit, follow and manage taskgate tasks.",
        epilog=__doc__.split("\n", 2)[2] if __doc__ else None,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"taskgate {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def add(name: str, handler: object, help_text: str, parent: Any = sub) -> argparse.ArgumentParser:
        p: argparse.ArgumentParser = parent.add_parser(name, parents=[common], help=help_text, description=help_text)
        p.set_defaults(handler=handler)
        return p

    p = add("submit", cmd_submit, "submit a text-to-video (or, with --image, image-to-video) task, or many from a JSON-lines file")
    p.add_argument("prompt", nargs="?")
    p.add_argument("--image", metavar="FILE|URL", help="input image (PNG, JPEG, WebP): a file, or an https URL the gateway fetches")
    p.add_argument("--task-type", help="default: image-to-video with --image, text-to-video without")
    p.add_argument("--file", metavar="TASKS.JSONL",
                   help="submit one task per line (JSON objects with prompt, model, frames, ..., as submit_many takes "
                        "them; '-' reads stdin); prints one result per line, in order")
    p.add_argument("--model", help="model id (default: the gateway's default model)")
    p.add_argument("--frames", type=int, help="number of frames (Wan: 4k+1)")
    p.add_argument("--width", type=int)
    p.add_argument("--height", type=int)
    p.add_argument("--steps", type=int, help="denoising steps")
    p.add_argument("--guidance", type=float, help="guidance scale")
    p.add_argument("--fps", type=int)
    p.add_argument("--seed", type=int)
    p.add_argument("--negative-prompt", default="")
    p.add_argument("--priority", choices=["low", "normal", "high"], default="normal")
    p.add_argument("--idempotency-key", help="same key + same request returns the existing task (default: a new uuid)")
    p.add_argument("--callback-url", help="webhook URL for terminal events")
    p.add_argument("--callback-event", action="append", default=[], choices=["CANCELED", "PROGRESS"], help="extra webhook events")
    p.add_argument("--metadata", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--max-retries", type=int)
    p.add_argument("--start-after", type=_start_time, metavar="WHEN", help="not before: a delay (10m, 2h) or an ISO 8601 time")
    p.add_argument("--max-queue-seconds", type=float, metavar="SECONDS",
                   help="queue TTL: TIMEOUT (QUEUE_TTL_EXPIRED) if no worker took the task within it")
    p.add_argument("--wait", action="store_true", help="show live progress until the task is finished")
    p.add_argument("--wait-timeout", type=float, metavar="SECONDS", help="give up waiting after this long (exit 11)")

    p = add("upload", cmd_upload, "store an input image; prints its sha256 for later submissions")
    p.add_argument("file", metavar="FILE")

    p = add("wait", cmd_wait, "show live progress of a task until it is finished")
    p.add_argument("task_id")
    p.add_argument("--wait-timeout", type=float, metavar="SECONDS")

    p = add("get", cmd_get, "show one task")
    p.add_argument("task_id")

    p = add("list", cmd_list, "list your tasks, newest first")
    p.add_argument("--status", action="append", default=[], help="only these states (repeat or comma-separate)")
    p.add_argument("--limit", type=int, default=50)

    p = add("watch", cmd_watch, "print each event of a task (with its version) until it is finished")
    p.add_argument("task_id")
    p.add_argument("--after-version", type=int, default=0, help="resume after this version")

    p = add("cancel", cmd_cancel, "cancel a task (soft: a running task finishes and its output is kept for reuse)")
    p.add_argument("task_id")
    p.add_argument("--hard", action="store_true", help="stop inference at the next step and discard the output")

    p = add("rotate-webhook-secret", cmd_rotate_webhook_secret,
            "a new webhook secret for your tenant, shown once (the current ones sign on during the overlap)")
    p.add_argument("--overlap", type=_age, default=24 * 3600.0, metavar="AGE",
                   help="how long the current secrets keep signing: 3600, 90m, 24h (default), 0 retires them now")

    p = add("regenerate", cmd_regenerate, "a new task from a finished one's request (HIGH when your tenant may use it)")
    p.add_argument("task_id")
    p.add_argument("--seed", type=int, help="the new task's seed (default: a new random one)")
    p.add_argument("--wait", action="store_true", help="show live progress until the task is finished")
    p.add_argument("--wait-timeout", type=float, metavar="SECONDS", help="give up waiting after this long (exit 11)")

    p = add("result", cmd_result, "download a finished task's video (checks its sha256)")
    p.add_argument("task_id")
    p.add_argument("-o", "--output", help="file to write (default: <task id>.mp4)")

    admin = add("admin", None, "operator commands (need an admin key)")
    admin_sub = admin.add_subparsers(dest="admin_command", required=True, metavar="ACTION")
    add("stats", cmd_admin_stats, "counts per model and state, workers, callbacks", admin_sub)
    p = add("stuck", cmd_admin_stuck, "tasks the scheduler considers stuck, with why", admin_sub)
    p.add_argument("--limit", type=int, default=100)
    p = add("requeue", cmd_admin_requeue, "requeue tasks by id or filter, in batches; replay failed ones as new tasks", admin_sub)
    p.add_argument("task_ids", nargs="*")
    p.add_argument("--status", action="append", default=[], help="filter: states (repeatable)")
    p.add_argument("--model", help="filter: model id")
    p.add_argument("--older-than", type=float, metavar="SECONDS", help="filter: not updated for this long")
    p.add_argument("--dry-run", action="store_true", help="report what would be requeued")
    p.add_argument("--batch-size", type=int, default=50)
    p.add_argument("--reason", default="cli requeue")
    p.add_argument(
        "--replay-finished", action="store_true",
        help="replay FAILED and TIMEOUT tasks once each as new tasks (same request and seed, past the tenant's limits)",
    )
    p = add("repair", cmd_admin_repair, "find and fix stuck or inconsistent tasks", admin_sub)
    p.add_argument("--dry-run", action="store_true", help="report only")
    p.add_argument("--batch-size", type=int, default=50)
    p = add("dead-letters", cmd_admin_dead_letters, "tasks that failed for good", admin_sub)
    p.add_argument("--limit", type=int, default=100)
    p = add("redeliver", cmd_admin_redeliver, "send a task's webhooks again", admin_sub)
    p.add_argument("task_id")
    p = add("deliveries", cmd_admin_deliveries, "webhook deliveries with their attempt count and last error", admin_sub)
    p.add_argument("--status", type=str.upper, choices=["PENDING", "DELIVERED", "FAILED"], help="only this state")
    p.add_argument("--limit", type=int, default=100)
    p = add("audit", cmd_admin_audit, "what admins did: who, what, on what, when, dry run or not (newest first)", admin_sub)
    p.add_argument("--by", metavar="ADMIN", help="only this admin's actions (a credential's name)")
    p.add_argument("--limit", type=int, default=100)
    p = add("rotate-secret", cmd_admin_rotate_secret, "a new webhook secret for a tenant (both sign during the overlap)", admin_sub)
    p.add_argument("--tenant", required=True)
    p.add_argument("--overlap", type=_age, default=24 * 3600.0, metavar="AGE",
                   help="how long the current secrets keep signing: 3600, 90m, 24h (default), 0 retires them now")
    p = add("keys", cmd_admin_keys, "API keys by prefix (never the keys themselves)", admin_sub)
    p.add_argument("--tenant", help="only this tenant's")
    p = add("revoke-key", cmd_admin_revoke_key, "revoke the live API keys with a prefix (as `admin keys` shows)", admin_sub)
    p.add_argument("prefix")
    p = add("usage", cmd_admin_usage, "metered GPU-seconds and slot seconds per tenant and model", admin_sub)
    p.add_argument("--tenant", help="only this tenant's")
    p.add_argument("--since", type=_age, default=86400.0, metavar="AGE", help="from this long ago: 90m, 12h, 7d (default 24h)")
    p.add_argument("--by-hour", action="store_true", help="one row per UTC hour")
    p = add("purge", cmd_admin_purge, "delete finished tasks, their history and outputs older than an age", admin_sub)
    p.add_argument("--older-than", type=_age, required=True, metavar="AGE", help="finished this long ago: 3600, 90m, 12h, 30d")
    p.add_argument("--dry-run", action="store_true", help="count only, delete nothing")
    return parser


async def _run(args: argparse.Namespace, out: Output) -> int:
    handler = args.handler
    client = AsyncTaskgateClient(client_config(args))
    try:
        return int(await handler(client, args, out))
    finally:
        await client.close()


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `taskgate` command; returns the exit code."""
    args = build_parser().parse_args(argv)
    for key, value in DEFAULTS.items():
        if not hasattr(args, key):
            setattr(args, key, value)
    out = Output(bool(args.json))
    try:
        return asyncio.run(_run(args, out))
    except TaskgateError as exc:
        return report_error(out, exc, admin=args.command == "admin")
    except WaitTimeout as exc:
        out.err.write(f"error: DEADLINE_EXCEEDED: {exc} — hint: the task goes on; follow it with `taskgate watch {exc.task_id}`\n")
        if out.json:
            out.document({"error": {"code": "DEADLINE_EXCEEDED", "message": str(exc), "task_id": exc.task_id}})
        return EXIT_TIMEOUT
    except CliError as exc:
        return report_cli_error(out, exc)
    except KeyboardInterrupt:
        out.err.write("\ninterrupted\n")
        return EXIT_INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
