"""The `taskgate` command's entry point: parse, run the command's handler with a client, map failures to exit codes."""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import Sequence

from taskgate_api.cli import EXIT_INTERRUPTED, EXIT_TIMEOUT, CliError, Output, report_cli_error
from taskgate_client import AsyncTaskgateClient, TaskgateError, WaitTimeout
from taskgate_client.cli.config import client_config
from taskgate_client.cli.output import report_error
from taskgate_client.cli.parser import DEFAULTS, build_parser


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
        out.err.write(
            f"error: DEADLINE_EXCEEDED: {exc} — hint: the task goes on; follow it with `taskgate watch {exc.task_id}`\n"
        )
        if out.json:
            out.document({"error": {"code": "DEADLINE_EXCEEDED", "message": str(exc), "task_id": exc.task_id}})
        return EXIT_TIMEOUT
    except CliError as exc:
        return report_cli_error(out, exc)
    except KeyboardInterrupt:
        out.err.write("\ninterrupted\n")
        return EXIT_INTERRUPTED
