"""The task commands: submit (one, or many from a file), upload, wait, get, list, watch, cancel, regenerate, result,
rotate-webhook-secret."""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import os
import sys
from datetime import datetime, timedelta
from pathlib import Path
from typing import TextIO

from taskgate_api._compat import UTC
from taskgate_api.cli import EXIT_BY_STATUS, EXIT_ERROR, EXIT_OK, EXIT_USAGE, CliError, Output, age
from taskgate_client import AsyncTaskgateClient, Status, SubmitItem, Task, TaskgateError
from taskgate_client.cli.output import print_event, print_rotated, print_task, short
from taskgate_client.progress import follow


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
        out.line(
            f"{image.sha256}\t{image.width}x{image.height}\t{image.size_bytes} bytes (sent as {image.source_format})"
        )
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
        end_user=args.end_user,
    )
    return await _submitted(client, out, task, args)


async def _submitted(client: AsyncTaskgateClient, out: Output, task: Task, args: argparse.Namespace) -> int:
    """A new task: printed, or with --wait followed until it ends."""
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
        [[t.task_id, t.status, f"{t.progress}%", t.model_id, t.created_at or "", short(t.prompt, 40)] for t in tasks],
    )
    return EXIT_OK


async def cmd_watch(client: AsyncTaskgateClient, args: argparse.Namespace, out: Output) -> int:
    async for event in client.watch(args.task_id, after_version=args.after_version):
        print_event(out, event)
    return EXIT_OK


async def cmd_logs(client: AsyncTaskgateClient, args: argparse.Namespace, out: Output) -> int:
    """The worker's log lines about a task: those stored so far, or with --follow each as it comes until the task
    ends."""
    lines = client.logs(args.task_id)
    follow_on = args.follow or (await client.get(args.task_id)).terminal  # an ended task's stream ends by itself
    try:
        while True:
            try:
                # without --follow, the stored lines arrive at once: a second without one means they are all out
                line = await (anext(lines) if follow_on else asyncio.wait_for(anext(lines), _STORED_WITHIN))
            except (StopAsyncIteration, asyncio.TimeoutError):  # asyncio.TimeoutError: not TimeoutError before 3.11
                return EXIT_OK
            if out.json:
                out.document({"task_id": line.task_id, "attempt": line.attempt, "sequence": line.sequence,
                              "at": line.at.isoformat() if line.at else None, "text": line.text})
            else:
                at = line.at.strftime("%H:%M:%S.%f")[:-3] if line.at else ""
                out.line(f"{at} attempt {line.attempt}: {line.text}")
    finally:
        await lines.aclose()  # type: ignore[attr-defined]


_STORED_WITHIN = 1.0


async def cmd_cancel(client: AsyncTaskgateClient, args: argparse.Namespace, out: Output) -> int:
    print_task(out, await client.cancel(args.task_id, hard=args.hard))
    return EXIT_OK


async def cmd_regenerate(client: AsyncTaskgateClient, args: argparse.Namespace, out: Output) -> int:
    task = await client.regenerate(args.task_id, seed=args.seed)
    return await _submitted(client, out, task, args)


async def cmd_result(client: AsyncTaskgateClient, args: argparse.Namespace, out: Output) -> int:
    path = Path(args.output or f"{args.task_id}.mp4")
    info = await client.download(args.task_id, path)
    if out.json:
        out.document({"task_id": args.task_id, "path": str(path), **info.to_dict()})
    else:
        out.line(f"wrote {path} ({info.size_bytes} bytes, {info.content_type}, sha256 {info.sha256} verified)")
    return EXIT_OK


def start_time(text: str) -> datetime:
    """When to start: a delay from now (`90`, `10m`, `2h`) or an ISO 8601 time (`2026-12-24T18:00:00+01:00`)."""
    try:
        return datetime.now(UTC) + timedelta(seconds=age(text))
    except argparse.ArgumentTypeError:
        pass
    try:
        moment = datetime.fromisoformat(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is neither a delay such as 10m nor an ISO 8601 time") from None
    return moment if moment.tzinfo else moment.astimezone()


async def cmd_rotate_webhook_secret(client: AsyncTaskgateClient, args: argparse.Namespace, out: Output) -> int:
    done = await client.rotate_own_webhook_secret(overlap=args.overlap)
    return print_rotated(done, None, out)
