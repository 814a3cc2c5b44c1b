"""`taskgate-keys` (`python -m taskgate.keys`): create, revoke and list API keys, straight in the database.

A server-side command: it needs the database (TASKGATE_DATABASE_URL, or the stack `make run` started), not the gateway.
Exit codes are the `taskgate` command's (taskgate_api.cli): 0 success, 2 usage, 3 no such key, 4 invalid tenant name, 10
database down.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Awaitable, Callable, Sequence

import asyncpg
import grpc

from taskgate import auth
from taskgate.config import GatewaySettings, load_settings
from taskgate.runtime import resolve_urls
from taskgate.sealing import Sealer
from taskgate.stackfile import SERVERS_FILE
from taskgate.states import Priority
from taskgate.store import tenants
from taskgate_api.cli import (
    EXIT_BY_CODE,
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_UNAVAILABLE,
    CliError,
    Output,
    age,
    find_state_dir,
    report_cli_error,
)

_PRIORITY_BY_NAME = {name: value for value, name in Priority.NAMES.items()}

Handler = Callable[[asyncpg.Connection, GatewaySettings, argparse.Namespace, Output], Awaitable[int]]


async def create(conn: asyncpg.Connection, settings: GatewaySettings, args: argparse.Namespace, out: Output) -> int:
    """Creates a key (and the tenant, with its webhook secret, if new) and prints it once."""
    invalid = EXIT_BY_CODE[grpc.StatusCode.INVALID_ARGUMENT]
    if not auth.valid_tenant_name(args.tenant):
        raise CliError(f"invalid tenant name {args.tenant!r}: use 1-64 of A-Z a-z 0-9 _ -", invalid)
    if args.admin:
        return await _create_admin(conn, settings, args, out)
    try:
        key, secret = await auth.create_key(
            conn,
            settings.api_key_pepper,
            args.tenant,
            max_pending=args.max_pending,
            submits_per_minute=args.submits_per_minute,
            max_priority=args.max_priority,
            sealer=Sealer.of(settings),
        )
    except asyncpg.CheckViolationError:
        raise CliError(f"invalid tenant name {args.tenant!r}: use 1-64 of A-Z a-z 0-9 _ -", invalid) from None
    if out.json:
        out.document(
            {"tenant": args.tenant, "api_key": key, "prefix": key[:10], "admin": args.admin, "webhook_secret": secret}
        )
        return EXIT_OK
    out.fields(
        [
            ("tenant", args.tenant),
            ("api key", key),
            ("admin", "yes" if args.admin else "no"),
            ("webhook secret", secret or "(unchanged: it was shown when the tenant was created)"),
        ]
    )
    out.line("\nStore these now: they are not shown again (only a hash of the key is kept).")
    return EXIT_OK


async def _create_admin(
    conn: asyncpg.Connection, settings: GatewaySettings, args: argparse.Namespace, out: Output
) -> int:
    """An admin credential (TaskAdmin only) named after --tenant, with its scope and expiry, printed once."""
    key, expires = await auth.create_admin_key(
        conn, settings.api_key_pepper, args.tenant, scope=args.scope, expires_in_seconds=args.expires_in
    )
    until = expires.isoformat() if expires is not None else None
    if out.json:
        out.document(
            {"admin": args.tenant, "api_key": key, "prefix": key[:10], "scope": args.scope, "expires_at": until}
        )
        return EXIT_OK
    out.fields([("admin", args.tenant), ("admin key", key), ("scope", args.scope), ("expires", until or "never")])
    out.line("\nStore it now: it is not shown again. It works on TaskAdmin (and WorkerControl) only, never to submit.")
    return EXIT_OK


async def tenant(conn: asyncpg.Connection, settings: GatewaySettings, args: argparse.Namespace, out: Output) -> int:
    """Changes an existing tenant's limits (those given) and prints them all."""
    changed = None
    if auth.valid_tenant_name(args.tenant):
        changed = await tenants.update_tenant(
            conn, args.tenant, max_pending=args.max_pending, submits_per_minute=args.submits_per_minute,
            max_priority=args.max_priority, share_weight=args.share_weight,
            gpu_seconds_per_day=args.gpu_seconds_per_day, gpu_seconds_per_month=args.gpu_seconds_per_month,
            tokens_per_day=args.tokens_per_day, tokens_per_month=args.tokens_per_month,
            max_pending_per_end_user=args.max_pending_per_end_user,
            submits_per_minute_per_end_user=args.submits_per_minute_per_end_user,
        )
    if changed is None:
        raise CliError(
            f"no tenant {args.tenant!r}",
            EXIT_BY_CODE[grpc.StatusCode.NOT_FOUND],
            "create it with `taskgate-keys create`",
        )
    doc = {
        "tenant": changed.id,
        "max_pending": changed.max_pending,
        "submits_per_minute": changed.submits_per_minute,
        "max_priority": Priority.NAMES[changed.max_priority].upper(),
        "share_weight": changed.share_weight,
        "gpu_seconds_per_day": changed.gpu_seconds_per_day,
        "gpu_seconds_per_month": changed.gpu_seconds_per_month,
        "max_pending_per_end_user": changed.max_pending_per_end_user,
        "submits_per_minute_per_end_user": changed.submits_per_minute_per_end_user,
        "tokens_per_day": changed.tokens_per_day,
        "tokens_per_month": changed.tokens_per_month,
    }
    if out.json:
        out.document(doc)
    else:
        out.fields(
            [
                (
                    k.replace("_", " "),
                    ("(none)" if k.startswith(("gpu", "tokens")) else "(global setting)") if v is None else v,
                )
                for k, v in doc.items()
            ]
        )
    return EXIT_OK


def _priority(text: str) -> int:
    try:
        return _PRIORITY_BY_NAME[text.lower()]
    except KeyError:
        raise argparse.ArgumentTypeError("must be LOW, NORMAL or HIGH") from None


def _budget(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError("must be a number of GPU-seconds") from None
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError("must be 0 (no budget) or more")
    return value


def _token_budget(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError("must be a whole number of tokens") from None
    if value < 0:
        raise argparse.ArgumentTypeError("must be 0 (no budget) or more")
    return value


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError("must be at least 1")
    return value


def _weight(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError("must be a number") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError("must be above 0")
    return value


async def revoke(conn: asyncpg.Connection, settings: GatewaySettings, args: argparse.Namespace, out: Output) -> int:
    """Revokes the live keys with a prefix."""
    rows = await tenants.revoke_api_keys(conn, args.prefix)
    if out.json:
        out.document({"revoked": [{"id": r.id, "tenant": r.tenant_id} for r in rows]})
    elif rows:
        out.line(f"revoked {len(rows)} key(s) with prefix {args.prefix}")
    if not rows:
        raise CliError(
            f"no live key with prefix {args.prefix!r}",
            EXIT_BY_CODE[grpc.StatusCode.NOT_FOUND],
            "see `taskgate-keys list`",
        )
    return EXIT_OK


async def list_keys(conn: asyncpg.Connection, settings: GatewaySettings, args: argparse.Namespace, out: Output) -> int:
    """Lists every key by prefix (the keys themselves are not stored)."""
    keys = [
        {"prefix": k.prefix, "tenant": k.tenant_id, "admin": k.scope or "", "created_at": k.created_at,
         "expires_at": k.expires_at, "revoked_at": k.revoked_at}
        for k in await tenants.list_api_keys(conn)
    ]
    if out.json:
        out.document({"keys": keys})
    elif not keys:
        out.line("no keys")
    else:
        out.table(
            ["PREFIX", "TENANT/ADMIN", "ADMIN SCOPE", "CREATED", "EXPIRES", "REVOKED"],
            [
                [k["prefix"], k["tenant"], k["admin"], k["created_at"], k["expires_at"] or "", k["revoked_at"] or ""]
                for k in keys
            ],
        )
    return EXIT_OK


async def seal_secrets(
    conn: asyncpg.Connection, settings: GatewaySettings, args: argparse.Namespace, out: Output
) -> int:
    """Seals every webhook secret with the newest key: ones stored before sealing existed, and ones an older key
    sealed (run it after prepending a key to TASKGATE_SECRETS_KEYS, before dropping the old one)."""
    sealer = Sealer.of(settings)
    changed = 0
    for secret_id, stored in await tenants.stored_webhook_secrets(conn):
        resealed = sealer.reseal(stored)
        changed += await tenants.replace_webhook_secret(conn, secret_id, stored=stored, new=resealed)
    if out.json:
        out.document({"resealed": changed})
    else:
        out.line(f"{changed} webhook secret(s) sealed with the newest key")
    return EXIT_OK


def build_parser() -> argparse.ArgumentParser:
    """The command line; --json is accepted before or after the action."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--json", action="store_true", default=argparse.SUPPRESS, help="machine-readable output (JSON)")
    parser = argparse.ArgumentParser(
        prog="taskgate-keys", parents=[common], description=__doc__.split("\n", 1)[0] if __doc__ else None
    )
    sub = parser.add_subparsers(dest="action", required=True, metavar="ACTION")

    limits = argparse.ArgumentParser(add_help=False)
    limits.add_argument("--tenant", required=True)
    limits.add_argument("--max-pending", type=_positive, help="the tenant's unfinished-task limit")
    limits.add_argument("--submits-per-minute", type=_positive, help="the tenant's submission rate limit")
    limits.add_argument(
        "--max-priority", type=_priority, metavar="{LOW,NORMAL,HIGH}",
        help="the highest priority the tenant may submit at (a new tenant: NORMAL)",
    )

    def add(name: str, handler: Handler, help_text: str, *, tenant_limits: bool = False) -> argparse.ArgumentParser:
        parents = [common, limits] if tenant_limits else [common]
        p = sub.add_parser(name, parents=parents, help=help_text, description=help_text)
        p.set_defaults(handler=handler)
        return p

    p = add("create", create, "create a key (and the tenant, with its webhook secret, if new)", tenant_limits=True)
    p.add_argument("--admin", action="store_true",
                   help="an admin credential named after --tenant instead: TaskAdmin only, never TaskGateway")
    p.add_argument("--scope", choices=auth.SCOPES, default=auth.OPERATOR,
                   help="with --admin: read (stats, listings, audit) or operator (also acts); default operator")
    p.add_argument("--expires-in", type=age, metavar="AGE", help="with --admin: it expires after 3600, 90m, 12h, 90d")
    p = add("tenant", tenant, "change an existing tenant's limits (those given) and show them", tenant_limits=True)
    p.add_argument(
        "--share-weight", type=_weight, help="the tenant's share against other tenants of one priority (default 1)"
    )
    p.add_argument(
        "--gpu-seconds-per-day", type=_budget, metavar="N", help="the tenant's GPU-second budget per UTC day (0: none)"
    )
    p.add_argument("--gpu-seconds-per-month", type=_budget, metavar="N", help="its budget per UTC month (0: none)")
    p.add_argument("--tokens-per-day", type=_token_budget, metavar="N",
                   help="the tenant's chat token budget per UTC day: input + max_output_tokens reserved (0: none)")
    p.add_argument(
        "--tokens-per-month", type=_token_budget, metavar="N", help="its token budget per UTC month (0: none)"
    )
    p.add_argument("--max-pending-per-end-user", type=_positive, metavar="N",
                   help="unfinished tasks each of the tenant's end users may hold (default: the global setting)")
    p.add_argument("--submits-per-minute-per-end-user", type=_positive, metavar="N",
                   help="submissions each of the tenant's end users may make per minute (default: the global setting)")
    p = add("revoke", revoke, "revoke keys by the prefix `list` shows")
    p.add_argument("prefix")
    add("list", list_keys, "list keys (prefixes only)")
    add("seal-secrets", seal_secrets, "seal every stored webhook secret with the newest key (after a key rotation)")
    return parser


async def _run(handler: Handler, args: argparse.Namespace, out: Output) -> int:
    settings = load_settings()
    if not settings.state_dir.is_absolute():
        settings = settings.model_copy(update={"state_dir": find_state_dir(settings.state_dir, marker=SERVERS_FILE)})
    try:
        database_url, _ = resolve_urls(settings)
    except SystemExit as exc:
        raise CliError(
            str(exc.code), EXIT_UNAVAILABLE, "start the stack with `make run`, or set TASKGATE_DATABASE_URL"
        ) from None
    try:
        conn = await asyncpg.connect(database_url, timeout=10)
    except (OSError, asyncpg.PostgresError, TimeoutError) as exc:
        raise CliError(
            f"cannot reach the database: {exc}", EXIT_UNAVAILABLE, "is the stack running (`make run`)?"
        ) from None
    try:
        return await handler(conn, settings, args, out)
    finally:
        await conn.close()


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `taskgate-keys` command; returns the exit code."""
    args = build_parser().parse_args(argv)
    out = Output(bool(getattr(args, "json", False)))
    try:
        return asyncio.run(_run(args.handler, args, out))
    except CliError as exc:
        return report_cli_error(out, exc)
    except KeyboardInterrupt:
        out.err.write("\ninterrupted\n")
        return EXIT_INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
