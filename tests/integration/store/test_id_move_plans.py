"""Every move and read that names one task by id and guards on its status costs that task, whatever the backlog in
that status: on statistics taken while no task was in it (a quiet moment, when autoanalyze usually runs) it reads task
by primary key, not a walk of a partial index of that status (#38; the queue move's trap, 92863d7, and the beat's,
8c2fae0)."""

from __future__ import annotations

from typing import Any

import pytest

from taskgate import sql
from taskgate.runtime import Backends
from tests.support.stale_stats import stale_backlog, task_rows_read

BACKLOG = 20_000

# every named parameter the moves of tasks.sql take, with a value that lets the guard pass
NAMED: dict[str, Any] = {
    "expected_version": None,
    "expected_attempt": None,
    "actor": "t",
    "reason": "r",
    "percent": 50,
    "lease_seconds": 30.0,
    "uri": "mem://r",
    "device_seconds": 0.0,
    "slot_seconds": 0.0,
    "wasted_seconds": 0.0,
    "content_type": "video/mp4",
    "size": 1,
    "sha256": "x",
    "reused": False,
    "text": None,
    "chars": None,
    "finish_reason": None,
    "input_tokens": None,
    "output_tokens": None,
    "error_code": "E",
    "error_message": "m",
    "worker_lost": False,
    "delay_seconds": 0.0,
    "in_company": False,
    "keep_order": False,
    "mode": "hard",
    "attempt": 1,
    "step": 1,
    "deleted": [],
}

# (statement, the backlog's state, its sources)
MOVES = [
    ("queue_task", "CREATED", ["CREATED"]),
    ("republish_task", "QUEUED", ["QUEUED"]),
    ("progress_task", "PROCESSING", ["PROCESSING"]),
    ("succeed_task", "PROCESSING", ["PROCESSING"]),
    ("fail_task", "PROCESSING", ["PROCESSING"]),
    ("retry_task", "PROCESSING", ["PROCESSING"]),
    ("release_task", "PROCESSING", ["PROCESSING"]),
    ("cancel_task", "QUEUED", ["CREATED", "QUEUED", "PROCESSING"]),
    ("cancel_task", "PROCESSING", ["CREATED", "QUEUED", "PROCESSING"]),
    ("timeout_task", "QUEUED", ["QUEUED", "PROCESSING"]),
    ("worker_checkpoint", "PROCESSING", None),  # named, without sources
]

# (statement, the backlog's state, its positional arguments for the task)
POSITIONAL: list[tuple[str, str, Any]] = [
    ("worker_checkpoint_intent", "PROCESSING", lambda i: [i, 1, "mem://c"]),
    ("worker_preview_intent", "PROCESSING", lambda i: [i, 1, "mem://p"]),
    ("sched_grant_grace", "PROCESSING", lambda i: [i, 1]),
    ("get_task", "QUEUED", lambda i: [i]),
]


async def _read(backends: Backends, state: str, run: Any) -> tuple[int, Any]:
    async with backends.pool.acquire() as conn:
        ids = await stale_backlog(conn, state, BACKLOG)
        target = ids[len(ids) // 2]
        undone = conn.transaction()  # the statement's effect is rolled back; the rows it read are what is checked
        await undone.start()
        before = await task_rows_read(conn)
        out = await run(conn, target)
        read = await task_rows_read(conn) - before
        await undone.rollback()
    return read, out


@pytest.mark.parametrize(("name", "state", "sources"), MOVES, ids=[f"{m[0]}-{m[1]}" for m in MOVES])
async def test_a_move_reads_its_task_not_the_backlog(
    backends: Backends, name: str, state: str, sources: list[str] | None
) -> None:
    params = sql.named_queries()[name].params

    async def run(conn: Any, target: int) -> Any:
        values = {**{p: NAMED[p] for p in params if p in NAMED}, "task_id": target}
        if sources is not None:
            values["sources"] = sources
        text, *args = sql.bind(name, **values)
        return await conn.fetch(text, *args)

    read, rows = await _read(backends, state, run)
    assert len(rows) == 1  # the guard passed: the task moved
    # the locking side and the move each read the task by primary key (3 rows); compared as the enum, the move walked
    # every task of the state in its partial index (20,002)
    assert read <= 10, f"{name}: {read:,} task rows read for one task ({BACKLOG:,} {state})"


@pytest.mark.parametrize(("name", "state", "args"), POSITIONAL, ids=[f"{p[0]}-{p[1]}" for p in POSITIONAL])
async def test_a_statement_by_id_reads_its_task_not_the_backlog(
    backends: Backends, name: str, state: str, args: Any
) -> None:
    async def run(conn: Any, target: int) -> Any:
        return await conn.fetch(sql.query(name), *args(target))

    read, rows = await _read(backends, state, run)
    assert len(rows) == 1  # the guard passed
    assert read <= 10, f"{name}: {read:,} task rows read for one task ({BACKLOG:,} {state})"


async def test_a_claim_reads_its_level_not_the_backlog(backends: Backends) -> None:
    async def run(conn: Any, target: int) -> Any:
        text, *args = sql.bind(
            "worker_claim",
            task_id=target,
            model_id="wan-tiny",
            cap=0,
            cluster_cap=False,
            worker_id="w9",
            lease_seconds=30.0,
            max_worker_losses=None,
            actor="w9",
            reason="claim",
        )
        return await conn.fetchrow(text, *args)

    read, row = await _read(backends, "QUEUED", run)
    assert row["verdict"] == "claimed"
    # the fair pick's skip scans of task_fair_idx and the claim's moves by primary key (10 rows); on the statistics'
    # choice of task_end_user_pending_idx the claim's update walked every queued task (20,009)
    assert read <= 20, f"worker_claim: {read:,} task rows read for one claim ({BACKLOG:,} QUEUED)"
