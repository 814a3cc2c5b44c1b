"""Files and batches: a tenant's stored files (the objects are in the result store), its batches, and each batch's
lines with the task each became (or why it was refused). The counts a batch reports are read from its tasks."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from taskgate import sql
from taskgate.model import TaskRow
from taskgate.store.pool import Conn


@dataclass(frozen=True, slots=True)
class FileRow:
    """A stored file as recorded."""

    id: int
    user_id: str
    purpose: str
    filename: str
    uri: str
    size_bytes: int
    sha256: str
    batch_id: int | None
    created_at: datetime


@dataclass(frozen=True, slots=True)
class BatchRow:
    """A batch as recorded, with its counts when read with them."""

    id: int
    user_id: str
    end_user: str
    input_file_id: int
    endpoint: str
    completion_window: str
    metadata: dict[str, str]
    status: str
    total_lines: int | None
    ingested_lines: int
    output_file_id: int | None
    error_file_id: int | None
    error_message: str | None
    created_at: datetime
    expires_at: datetime
    moments: dict[str, datetime | None] = field(default_factory=dict)  # in_progress_at, ..., cancelled_at
    source_file_id: int | None = None  # the caller's file a face translated into the input
    done: int = 0  # lines whose task SUCCEEDED
    failed: int = 0  # refused lines and tasks FAILED, TIMEOUT or CANCELED
    unfinished: int = 0
    expired: int = 0  # tasks whose queue TTL passed


MOMENTS = ("in_progress_at", "finalizing_at", "completed_at", "failed_at", "cancelling_at", "cancelled_at")


@dataclass(frozen=True, slots=True)
class Item:
    """One line of a batch: its task (None when refused) or its refusal."""

    line: int
    custom_id: str
    task: TaskRow | None
    error: dict[str, Any] | None


def _file(rec: Any) -> FileRow:
    return FileRow(rec["id"], rec["user_id"], rec["purpose"], rec["filename"], rec["uri"], rec["size_bytes"],
                   rec["sha256"], rec["batch_id"], rec["created_at"])


def _batch(rec: Any) -> BatchRow:
    keys = set(rec.keys())
    counts = {k: int(rec[k]) for k in ("done", "failed", "unfinished", "expired") if k in keys}
    return BatchRow(
        rec["id"], rec["user_id"], rec["end_user"], rec["input_file_id"], rec["endpoint"], rec["completion_window"],
        dict(rec["metadata"] or {}), rec["status"], rec["total_lines"], rec["ingested_lines"], rec["output_file_id"],
        rec["error_file_id"], rec["error_message"], rec["created_at"], rec["expires_at"],
        moments={k: rec[k] for k in MOMENTS}, source_file_id=rec["source_file_id"], **counts,
    )


async def insert_file(
    db: Conn, file_id: int, tenant: str, purpose: str, filename: str, uri: str, size: int, sha256: str,
    batch_id: int | None = None,
) -> FileRow:
    """Records a file whose object is already written."""
    return _file(
        await db.fetchrow(
            *sql.bind(
                "file_insert",
                file_id=file_id,
                user_id=tenant,
                purpose=purpose,
                filename=filename,
                uri=uri,
                size_bytes=size,
                sha256=sha256,
                batch_id=batch_id,
            )
        )
    )


async def get_file(db: Conn, tenant: str, file_id: int) -> FileRow | None:
    """One of the tenant's files, or None."""
    rec = await db.fetchrow(sql.query("file_get"), tenant, file_id)
    return None if rec is None else _file(rec)


async def list_files(db: Conn, tenant: str, purpose: str, after: int | None, limit: int) -> list[FileRow]:
    """Up to `limit` of the tenant's files after the id `after`, newest first."""
    return [_file(r) for r in await db.fetch(sql.query("file_list"), tenant, purpose, after, limit)]


async def insert_batch(
    db: Conn, batch_id: int, tenant: str, end_user: str, input_file_id: int, endpoint: str, window: str,
    metadata: dict[str, str], window_seconds: float, lease_seconds: float, source_file_id: int | None = None,
) -> BatchRow:
    """A new batch, validating, its ingest's lease taken."""
    rec = await db.fetchrow(
        *sql.bind(
            "batch_insert",
            batch_id=batch_id,
            user_id=tenant,
            end_user=end_user,
            input_file_id=input_file_id,
            endpoint=endpoint,
            completion_window=window,
            metadata=metadata,
            window_seconds=window_seconds,
            lease_seconds=lease_seconds,
            source_file_id=source_file_id,
        )
    )
    return _batch(rec)


async def get_batch(db: Conn, tenant: str, batch_id: int) -> BatchRow | None:
    """One of the tenant's batches with its counts, or None."""
    rec = await db.fetchrow(sql.query("batch_get"), tenant, batch_id)
    return None if rec is None else _batch(rec)


async def list_batches(db: Conn, tenant: str, after: int | None, limit: int) -> list[BatchRow]:
    """Up to `limit` of the tenant's batches after the id `after`, newest first, with their counts."""
    return [_batch(r) for r in await db.fetch(sql.query("batch_list"), tenant, after, limit)]


async def take_lease(db: Conn, batch_id: int, lease_seconds: float) -> BatchRow | None:
    """The batch's lease, when it is validating or finalizing and nobody holds it; None otherwise."""
    rec = await db.fetchrow(sql.query("batch_take_lease"), batch_id, lease_seconds)
    return None if rec is None else _batch(rec)


async def set_total(db: Conn, batch_id: int, lines: int) -> None:
    """The input's line count, once read."""
    await db.execute(sql.query("batch_set_total"), batch_id, lines)


async def record(
    db: Conn, batch_id: int, start: int, custom_ids: list[str], task_ids: list[int | None],
    errors: list[dict[str, Any] | None], lease_seconds: float,
) -> bool:
    """Records a chunk of lines from `start` with the ingest's progress; False when another ingest recorded them or
    the batch stopped taking lines."""
    lines = list(range(start, start + len(custom_ids)))
    rows = await db.fetch(
        *sql.bind(
            "batch_record",
            batch_id=batch_id,
            start=start,
            lines=lines,
            custom_ids=custom_ids,
            task_ids=task_ids,
            errors=errors,
            lease_seconds=lease_seconds,
        )
    )
    return len(rows) == len(lines)


async def renew(db: Conn, batch_id: int, start: int, lease_seconds: float) -> bool:
    """The ingest's lease renewed; False when the batch no longer takes lines from `start`."""
    return await db.fetchrow(sql.query("batch_renew"), batch_id, start, lease_seconds) is not None


async def fail(db: Conn, batch_id: int, message: str) -> BatchRow | None:
    """A batch whose input could not be used: failed, with why."""
    rec = await db.fetchrow(sql.query("batch_fail"), batch_id, message)
    return None if rec is None else _batch(rec)


async def finalize(db: Conn, batch: BatchRow, lease_seconds: float) -> BatchRow | None:
    """The finalizer's lease of a batch whose tasks all finished (in_progress → finalizing, or a cancelling one);
    None when it is not due or another holds it."""
    name = "batch_cancelled_finalize" if batch.status == "cancelling" else "batch_finalize"
    rec = await db.fetchrow(sql.query(name), batch.id, lease_seconds)
    return None if rec is None else _batch(rec)


async def items(db: Conn, batch_id: int) -> list[Item]:
    """The batch's lines in order, each with its task or its refusal."""
    out: list[Item] = []
    for rec in await db.fetch(sql.query("batch_items"), batch_id):
        task = TaskRow.from_record(rec) if rec["id"] is not None else None
        out.append(Item(rec["line"], rec["custom_id"], task, rec["error"]))
    return out


async def unfinished_tasks(db: Conn, batch_id: int) -> list[int]:
    """The ids of the batch's tasks not finished yet."""
    return [r["id"] for r in await db.fetch(sql.query("batch_unfinished_tasks"), batch_id)]


async def complete(
    db: Conn, batch_id: int, output_file_id: int | None, error_file_id: int | None, expired: bool
) -> BatchRow | None:
    """The batch's files recorded and its end state set; None when it was not finalizing or cancelling."""
    rec = await db.fetchrow(sql.query("batch_complete"), batch_id, output_file_id, error_file_id, expired)
    return None if rec is None else _batch(rec)


async def cancel(db: Conn, tenant: str, batch_id: int) -> BatchRow | None:
    """A validating or in-progress batch of the tenant moved to cancelling; None when it was not one."""
    rec = await db.fetchrow(sql.query("batch_cancel"), tenant, batch_id)
    return None if rec is None else _batch(rec)
