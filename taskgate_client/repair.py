"""The repair tool: find stuck tasks over TaskAdmin, print the plan, requeue them in batches, stop on the first
error."""

from __future__ import annotations

import sys
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TextIO

import grpc

from taskgate_api.v1 import admin_pb2, admin_pb2_grpc
from taskgate_client.types import Status


@dataclass
class RepairResult:
    """What a repair run found and did; `error` is set when it stopped early."""

    stuck: int = 0
    batches: int = 0
    outcomes: Counter[str] = field(default_factory=Counter)  # REQUEUED / WOULD_REQUEUE / SKIPPED
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


def _status(value: int) -> str:
    try:
        return Status.from_proto(value).value
    except ValueError:
        return "?"


def _summary(counts: Sequence[admin_pb2.StateCount]) -> str:
    if not counts:
        return "no unfinished tasks"
    return ", ".join(f"{c.model_id} {_status(c.status)}={c.count}" for c in counts)


async def repair(
    stub: admin_pb2_grpc.TaskAdminAsyncStub,
    dry_run: bool,
    batch_size: int = 50,
    out: TextIO | None = None,
    *,
    metadata: Sequence[tuple[str, str]] = (),
    limit: int = 0,
    call_timeout: float | None = 60.0,
) -> RepairResult:
    """Lists stuck tasks (ListStuckTasks), prints the plan, then requeues them (RequeueTasks) batch by batch,
    printing each batch and the state summary after it. With `dry_run` nothing changes: the server reports what
    each batch would do. Stops at the first error and returns it in the result (never raises a gRPC error).

    `metadata` carries the admin key (("authorization", "Bearer tg_...")); `limit` caps the stuck tasks listed
    (0 = the server's maximum); `call_timeout` bounds each call."""
    write = (out or sys.stdout).write
    result = RepairResult()
    try:
        listing = await stub.ListStuckTasks(
            admin_pb2.ListStuckTasksRequest(limit=limit), metadata=tuple(metadata), timeout=call_timeout
        )
    except grpc.aio.AioRpcError as exc:
        result.error = f"{exc.code().name}: {exc.details()}"
        write(f"error: listing stuck tasks failed: {result.error}\n")
        return result
    stuck = list(listing.tasks)
    result.stuck = len(stuck)
    write(f"stuck tasks: {len(stuck)}\n")
    if not stuck:
        return result
    for item in stuck:
        t = item.task
        write(
            f"  {t.id}  {t.model_id}  {_status(t.status)}  {item.reason}  attempt={t.attempt} "
            f"worker={t.worker_id or '-'}\n"
        )
    mode = "dry run: nothing will change" if dry_run else "acting now"
    write(f"plan: requeue {len(stuck)} task(s) in batches of {batch_size} ({mode})\n")
    request = admin_pb2.RequeueTasksRequest(
        task_ids=[item.task.id for item in stuck], dry_run=dry_run, batch_size=batch_size, reason="repair"
    )
    try:
        async for batch in stub.RequeueTasks(request, metadata=tuple(metadata), timeout=call_timeout):
            result.batches += 1
            counts = Counter(i.action for i in batch.items)
            result.outcomes.update(counts)
            write(f"batch {batch.batch}: " + ", ".join(f"{n} {a.lower()}" for a, n in sorted(counts.items())) + "\n")
            for i in batch.items:
                write(f"  {i.task_id}  {_status(i.from_status)}  {i.action}  {i.detail}\n")
            write(f"  after batch {batch.batch}: {_summary(batch.summary)}\n")
    except grpc.aio.AioRpcError as exc:
        result.error = f"{exc.code().name}: {exc.details()}"
        write(f"error: stopped after {result.batches} batch(es): {result.error}\n")
        return result
    done = ", ".join(f"{n} {a.lower()}" for a, n in sorted(result.outcomes.items()))
    write(f"done: {done}\n")
    return result
