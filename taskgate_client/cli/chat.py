"""`taskgate chat`: submit a chat task and stream its answer to the terminal as it is generated."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
from pathlib import Path

from taskgate_api.cli import EXIT_BY_STATUS, EXIT_ERROR, EXIT_OK, EXIT_USAGE, CliError, Output
from taskgate_client import AsyncTaskgateClient, Status, TaskFailed
from taskgate_client.cli.output import print_task
from taskgate_client.types import ChatInput


def _read(file: str) -> bytes:
    return sys.stdin.buffer.read() if file == "-" else Path(file).read_bytes()


async def _message(client: AsyncTaskgateClient, args: argparse.Namespace) -> ChatInput:
    """The user's message: the prompt, then the --file's text (a document, a diff; '-' reads stdin), uploaded as a
    text attachment that the gateway appends to the prompt after a blank line."""
    if args.file is None:
        if not args.prompt:
            raise CliError("give a message (or --file doc.txt)", EXIT_USAGE)
        return str(args.prompt)
    try:
        data = await asyncio.to_thread(_read, args.file)
        data.decode("utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise CliError(f"cannot read --file {args.file}: {exc}", EXIT_USAGE) from None
    attached = await client.upload_text(data)
    return [{"role": "user", "content": args.prompt or "", "content_sha256": attached.sha256}]


async def cmd_chat(client: AsyncTaskgateClient, args: argparse.Namespace, out: Output) -> int:
    task = await client.chat(
        await _message(client, args),
        args.model,
        system=args.system,
        max_output_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        stop=args.stop,
        seed=args.seed,
        priority=args.priority,
        idempotency_key=args.idempotency_key,
        end_user=args.end_user,
    )
    if args.wait or out.json:  # the whole answer at the end (or the task as JSON): no live text
        done = await client.wait(task.task_id, args.wait_timeout)
        if out.json:
            print_task(out, done)
        elif done.status is Status.SUCCEEDED:
            out.out.write(await client.text(task.task_id) + "\n")
        return _ended(out, done.status, done.error_message)
    out.err.write(f"task {task.task_id}\n")
    wrote = False
    async for delta in client.stream_text(task.task_id):
        if delta.restarted:  # a retry after a lost worker: what follows replaces the text after `offset`
            out.out.write(f"\n[attempt {delta.attempt} restarted the answer at character {delta.offset}]\n")
        out.out.write(delta)
        out.out.flush()
        wrote = True
    done = await client.get(task.task_id)
    if wrote:
        out.out.write("\n")
    elif done.status is Status.SUCCEEDED:  # its stream expired or carried nothing: the answer itself
        with contextlib.suppress(TaskFailed):
            out.out.write(await client.text(task.task_id) + "\n")
    return _ended(out, done.status, done.error_message)


def _ended(out: Output, status: Status, message: str) -> int:
    if status is not Status.SUCCEEDED:
        out.err.write(f"chat task ended {status.name}{': ' + message if message else ''}\n")
    return EXIT_BY_STATUS.get(status, EXIT_ERROR) if status is not Status.SUCCEEDED else EXIT_OK


def add_arguments(p: argparse.ArgumentParser) -> None:
    """`taskgate chat`'s arguments."""
    p.add_argument("prompt", nargs="?", help="your message")
    p.add_argument("--system", help="a system message before yours")
    p.add_argument("--file", metavar="FILE",
                   help="a text file (a document, a diff) uploaded and appended to the message; '-' reads stdin")
    p.add_argument("--max-tokens", type=int, metavar="N", help="at most this many generated tokens")
    p.add_argument("--model", help="model id (default: the gateway's default chat model)")
    p.add_argument("--temperature", type=float)
    p.add_argument("--top-p", type=float)
    p.add_argument("--stop", action="append", default=[], metavar="TEXT", help="stop at this text (repeatable)")
    p.add_argument("--seed", type=int)
    p.add_argument("--priority", choices=["low", "normal", "high"], default="normal")
    p.add_argument("--idempotency-key", help="same key + same request returns the existing task (default: a new uuid)")
    p.add_argument("--end-user", metavar="ID", help="your own user the task is for")
    p.add_argument("--wait", action="store_true",
                   help="print the whole answer once the task has finished instead of streaming it as it is generated")
    p.add_argument("--wait-timeout", type=float, metavar="SECONDS", help="give up waiting after this long (exit 11)")
