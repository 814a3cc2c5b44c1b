"""The `taskgate` command line: every command's arguments, and options accepted before or after the command."""

from __future__ import annotations

import argparse
from typing import Any

from taskgate_api.cli import EXIT_CODES, age
from taskgate_api.version import __version__
from taskgate_client.cli.admin import (
    cmd_admin_audit,
    cmd_admin_dead_letters,
    cmd_admin_deliveries,
    cmd_admin_keys,
    cmd_admin_purge,
    cmd_admin_redeliver,
    cmd_admin_repair,
    cmd_admin_requeue,
    cmd_admin_revoke_key,
    cmd_admin_rotate_secret,
    cmd_admin_stats,
    cmd_admin_stuck,
    cmd_admin_usage,
)
from taskgate_client.cli.chat import add_arguments as add_chat_arguments
from taskgate_client.cli.chat import cmd_chat
from taskgate_client.cli.tasks import (
    cmd_cancel,
    cmd_get,
    cmd_list,
    cmd_logs,
    cmd_regenerate,
    cmd_result,
    cmd_rotate_webhook_secret,
    cmd_submit,
    cmd_upload,
    cmd_wait,
    cmd_watch,
    start_time,
)


def _common() -> argparse.ArgumentParser:
    """Options accepted before or after the command (defaults suppressed so the later position does not reset them)."""
    p = argparse.ArgumentParser(add_help=False)
    S = argparse.SUPPRESS
    p.add_argument(
        "--json", action="store_true", default=S, help="machine-readable output (JSON; JSON lines for streams)"
    )
    p.add_argument(
        "--address", default=S, help="gateway host:port (env TASKGATE_ADDRESS; default: the `make run` stack)"
    )
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
        epilog=EXIT_CODES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"taskgate {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def add(name: str, handler: object, help_text: str, parent: Any = sub) -> argparse.ArgumentParser:
        p: argparse.ArgumentParser = parent.add_parser(name, parents=[common], help=help_text, description=help_text)
        p.set_defaults(handler=handler)
        return p

    p = add(
        "submit",
        cmd_submit,
        "submit a text-to-video (or, with --image, image-to-video) task, or many from a JSON-lines file",
    )
    p.add_argument("prompt", nargs="?")
    p.add_argument(
        "--image", metavar="FILE|URL", help="input image (PNG, JPEG, WebP): a file, or an https URL the gateway fetches"
    )
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
    p.add_argument("--end-user", metavar="ID",
                   help="your own user the task is for (opaque, at most 128 bytes): its own limits, keys and usage")
    p.add_argument("--callback-url", help="webhook URL for terminal events")
    p.add_argument(
        "--callback-event",
        action="append",
        default=[],
        choices=["CANCELED", "OUTPUT", "PROGRESS"],
        help="extra webhook events",
    )
    p.add_argument("--metadata", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--max-retries", type=int)
    p.add_argument(
        "--start-after", type=start_time, metavar="WHEN", help="not before: a delay (10m, 2h) or an ISO 8601 time"
    )
    p.add_argument("--max-queue-seconds", type=float, metavar="SECONDS",
                   help="queue TTL: TIMEOUT (QUEUE_TTL_EXPIRED) if no worker took the task within it")
    p.add_argument("--wait", action="store_true", help="show live progress until the task is finished")
    p.add_argument("--wait-timeout", type=float, metavar="SECONDS", help="give up waiting after this long (exit 11)")

    p = add("chat", cmd_chat, "submit a chat task and stream its answer as it is generated")
    add_chat_arguments(p)

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

    p = add("logs", cmd_logs, "print the worker's log lines about a task (model load, warm-up, each phase's seconds)")
    p.add_argument("task_id")
    p.add_argument("--follow", "-f", action="store_true", help="keep printing new lines until the task is finished")

    p = add("cancel", cmd_cancel, "cancel a task (soft: a running task finishes and its output is kept for reuse)")
    p.add_argument("task_id")
    p.add_argument("--hard", action="store_true", help="stop inference at the next step and discard the output")

    p = add("rotate-webhook-secret", cmd_rotate_webhook_secret,
            "a new webhook secret for your tenant, shown once (the current ones sign on during the overlap)")
    p.add_argument("--overlap", type=age, default=24 * 3600.0, metavar="AGE",
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
    p = add(
        "requeue",
        cmd_admin_requeue,
        "requeue tasks by id or filter, in batches; replay failed ones as new tasks",
        admin_sub,
    )
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
    p = add(
        "audit", cmd_admin_audit, "what admins did: who, what, on what, when, dry run or not (newest first)", admin_sub
    )
    p.add_argument("--by", metavar="ADMIN", help="only this admin's actions (a credential's name)")
    p.add_argument("--limit", type=int, default=100)
    p = add(
        "rotate-secret",
        cmd_admin_rotate_secret,
        "a new webhook secret for a tenant (both sign during the overlap)",
        admin_sub,
    )
    p.add_argument("--tenant", required=True)
    p.add_argument("--overlap", type=age, default=24 * 3600.0, metavar="AGE",
                   help="how long the current secrets keep signing: 3600, 90m, 24h (default), 0 retires them now")
    p = add("keys", cmd_admin_keys, "API keys by prefix (never the keys themselves)", admin_sub)
    p.add_argument("--tenant", help="only this tenant's")
    p = add(
        "revoke-key", cmd_admin_revoke_key, "revoke the live API keys with a prefix (as `admin keys` shows)", admin_sub
    )
    p.add_argument("prefix")
    p = add("usage", cmd_admin_usage, "metered GPU-seconds and slot seconds per tenant and model", admin_sub)
    p.add_argument("--tenant", help="only this tenant's")
    p.add_argument(
        "--since", type=age, default=86400.0, metavar="AGE", help="from this long ago: 90m, 12h, 7d (default 24h)"
    )
    p.add_argument("--by-hour", action="store_true", help="one row per UTC hour")
    p.add_argument("--by-end-user", action="store_true", help="one row per end user of each tenant")
    p.add_argument("--end-user", metavar="ID", help="only this end user's (with --tenant; '' the tenant's own tasks)")
    p = add("purge", cmd_admin_purge, "delete finished tasks, their history and outputs older than an age", admin_sub)
    p.add_argument(
        "--older-than", type=age, required=True, metavar="AGE", help="finished this long ago: 3600, 90m, 12h, 30d"
    )
    p.add_argument("--dry-run", action="store_true", help="count only, delete nothing")
    return parser
