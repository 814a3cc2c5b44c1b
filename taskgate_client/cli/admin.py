"""The `admin` commands (an admin key): stats, stuck, requeue, repair, dead-letters, redeliver, deliveries, audit,
rotate-secret, keys, revoke-key, usage, purge."""

from __future__ import annotations

import argparse
import io
from datetime import datetime, timedelta

import grpc

from taskgate_api._compat import UTC
from taskgate_api.cli import EXIT_BY_CODE, EXIT_ERROR, EXIT_OK, EXIT_USAGE, CliError, Output, proto_dict
from taskgate_api.v1 import admin_pb2
from taskgate_client import AsyncTaskgateClient
from taskgate_client.cli.output import (
    callback_name,
    duration_seconds,
    print_rotated,
    short,
    status_name,
    timestamp_text,
)
from taskgate_client.repair import repair

EXIT_SKIPPED = 13  # admin requeue: some task was neither requeued nor replayed (each item's detail says why)


async def cmd_admin_stats(client: AsyncTaskgateClient, args: argparse.Namespace, out: Output) -> int:
    stats = await client.stats()
    if out.json:
        out.document(proto_dict(stats))
        return EXIT_OK
    out.table(
        ["MODEL", "STATUS", "COUNT"],
        [[c.model_id, status_name(c.status), c.count] for c in stats.counts] or [["-", "-", 0]],
    )
    if stats.HasField("oldest_queued_age"):
        out.line(f"\noldest queued task: {duration_seconds(stats.oldest_queued_age):.1f}s")
    out.line(f"running: {stats.running} of {stats.capacity} slots (the live workers'; beyond them tasks wait QUEUED)")
    if stats.workers:
        out.line()
        out.table(
            ["WORKER", "RUNNING", "SLOTS", "ALIVE", "LAST HEARTBEAT"],
            [
                [w.worker_id, w.running, w.slots, "yes" if w.alive else "no", timestamp_text(w.last_heartbeat)]
                for w in stats.workers
            ],
        )
    if stats.callbacks:
        out.line()
        out.table(
            ["CALLBACKS", "COUNT"],
            [[callback_name(c.status), c.count] for c in stats.callbacks],
        )
    return EXIT_OK


async def cmd_admin_stuck(client: AsyncTaskgateClient, args: argparse.Namespace, out: Output) -> int:
    return out.listing(
        "tasks",
        await client.stuck(args.limit),
        "no stuck tasks",
        ["TASK ID", "STATUS", "MODEL", "ATTEMPT", "REASON"],
        lambda s: [s.task.id, status_name(s.task.status), s.task.model_id, s.task.attempt, s.reason],
    )


def _print_batch(out: Output, batch: admin_pb2.RequeueBatch) -> None:
    if out.json:
        out.document(proto_dict(batch))
        return
    label = " (dry run)" if batch.dry_run else ""
    out.line(f"batch {batch.batch}{label}: {len(batch.items)} task(s)")
    for item in batch.items:
        out.line(f"  {item.task_id}  {status_name(item.from_status):<10} {item.action:<14} {item.detail}".rstrip())


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
        summary = {
            "stuck": result.stuck,
            "batches": result.batches,
            "outcomes": dict(result.outcomes),
            "error": result.error,
        }
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
            d.task.id,
            status_name(d.task.status),
            d.task.model_id,
            timestamp_text(d.dead_at),
            short(d.reason, 60),
            d.replayed_as,
        ],
    )


async def cmd_admin_redeliver(client: AsyncTaskgateClient, args: argparse.Namespace, out: Output) -> int:
    return out.listing(
        "deliveries",
        await client.redeliver(args.task_id),
        "nothing to redeliver",
        ["DELIVERY", "WEBHOOK ID", "EVENT", "STATUS", "ATTEMPTS"],
        lambda d: [d.delivery_id, d.webhook_id, d.event, callback_name(d.status), d.attempts],
    )


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
        lambda d: [d.delivery_id, d.task_id, d.tenant, d.event, callback_name(d.status), d.attempts,
                   short(d.last_error or (f"HTTP {d.last_status_code}" if d.last_status_code else ""), 60)],
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
        lambda e: [timestamp_text(e.at), e.admin, e.prefix, e.action, e.target, "yes" if e.dry_run else ""],
    )


async def cmd_admin_rotate_secret(client: AsyncTaskgateClient, args: argparse.Namespace, out: Output) -> int:
    done = await client.rotate_webhook_secret(args.tenant, overlap=args.overlap)
    return print_rotated(done, args.tenant, out)


async def cmd_admin_keys(client: AsyncTaskgateClient, args: argparse.Namespace, out: Output) -> int:
    return out.listing(
        "keys",
        await client.api_keys(args.tenant),
        "no keys",
        ["PREFIX", "TENANT/ADMIN", "ADMIN SCOPE", "CREATED", "EXPIRES", "REVOKED"],
        lambda k: [k.prefix, k.tenant, k.scope if k.admin else "", timestamp_text(k.created_at),
                   timestamp_text(k.expires_at) if k.HasField("expires_at") else "",
                   timestamp_text(k.revoked_at) if k.HasField("revoked_at") else ""],
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
    if args.end_user is not None and not args.tenant:
        raise CliError("--end-user needs --tenant: end users are each tenant's own", EXIT_USAGE)
    per_user = args.by_end_user or args.end_user is not None
    found = await client.usage(
        args.tenant, since=since, by_hour=args.by_hour, by_end_user=args.by_end_user, end_user=args.end_user
    )
    if out.json:
        out.document(proto_dict(found))
        return EXIT_OK
    head = ["TENANT", *(["END USER"] if per_user else []), "MODEL", *(["HOUR (UTC)"] if args.by_hour else []),
            "GPU-SECONDS", "SLOT SECONDS", "ATTEMPTS", "INPUT TOKENS", "OUTPUT TOKENS"]
    rows = [
        [u.tenant, *([u.end_user or "(tenant)"] if per_user else []), u.model_id,
         *([u.hour.ToDatetime().strftime("%Y-%m-%d %H:00")] if args.by_hour else []),
         f"{u.gpu_seconds:.1f}", f"{u.slot_seconds:.1f}", u.attempts, u.input_tokens, u.output_tokens]
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
    why = {
        "webhook_undelivered": "webhook not delivered yet",
        "attempt_running": "soft-cancelled, attempt still running",
    }
    for reason, n in kept.items():
        out.line(f"{'would keep' if done.dry_run else 'kept'}: {n} finished task(s) ({why.get(reason, reason)})")
    return EXIT_OK
