"""Metering's reads: the seconds tasks' attempts used, summed per tenant, model and hour (the usage_hour rows that
functions/usage.sql keeps from each attempt's final write)."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from taskgate import sql
from taskgate.store.pool import Conn


@dataclass(frozen=True, slots=True)
class Usage:
    """One tenant's use of one model over a range (or in one hour): device and slot seconds, attempts ended."""

    tenant_id: str
    model_id: str
    hour: datetime | None  # None: summed over the whole range
    device_seconds: float
    slot_seconds: float
    attempts: int
    end_user: str | None = None  # by end user only: whose ('' the tenant's own tasks); None: summed over them
    input_tokens: int = 0  # chat tasks' input tokens (their succeeding attempts')
    output_tokens: int = 0  # chat tasks' generated tokens


async def usage(
    db: Conn, *, since: datetime, until: datetime, tenant_id: str | None = None, by_hour: bool = False, limit: int,
    by_end_user: bool = False, end_user: str | None = None, within: float | None = None,
) -> list[Usage]:
    """Metered use from `since`'s hour to before `until`, by tenant and model (and hour, and end user), at most
    `limit` rows; `end_user`: only that end user's ('' the tenant's own tasks)."""
    rows = await db.fetch(
        *sql.bind(
            "usage_rows",
            tenant_id=tenant_id,
            since=since,
            until=until,
            by_hour=by_hour,
            limit=limit,
            by_end_user=by_end_user,
            end_user=end_user,
        ),
        timeout=within,
    )
    return [
        Usage(r["tenant_id"], r["model_id"], r["hour"], r["device_seconds"], r["slot_seconds"], r["attempts"],
              r["end_user"], r["input_tokens"], r["output_tokens"])
        for r in rows
    ]
