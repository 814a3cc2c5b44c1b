"""The same submit and GetTask figures with a large history of finished tasks in the table."""

from __future__ import annotations

import time
from concurrent.futures import ProcessPoolExecutor

from bench import throughput
from bench.load import LoadResult
from bench.stack import TENANT, BenchStack
from bench.stats import Report, ms
from taskgate.store import bench as bench_store

BACKLOG = 100_000  # QUEUED tasks ahead of the polled ones (issue 38: a poll costs the same behind them)


async def fill(stack: BenchStack, rows: int) -> float:
    """Inserts `rows` finished tasks (a tenth of them the bench tenant's) and their terminal events as the retentions
    leave them, vacuums; returns seconds."""
    start = time.monotonic()
    async with stack.db.acquire() as conn:
        await bench_store.fill_history(
            conn, rows=rows, tenant=TENANT, events_seconds=stack.settings.retain_events_seconds,
            results_seconds=stack.settings.retain_results_seconds,
        )
    return time.monotonic() - start


def _p99(result: LoadResult) -> float:
    return ms(result.latencies)[1]


async def compare(
    stack: BenchStack, executor: ProcessPoolExecutor, opts: throughput.Options, report: Report, rows: int,
    empty_submit: dict[int, LoadResult], empty_get: dict[int, LoadResult],
) -> None:
    """Fills the table, measures again, and reports each p99 as a ratio of the empty table's."""
    section = f"with {rows:,} historical tasks"
    seconds = await fill(stack, rows)
    report.add(section, "bulk insert of the history (tasks + events, VACUUM ANALYZE)", seconds, "s")
    levels = tuple(level for level in (1, 64) if level in empty_submit)
    full_submit = await throughput.submit_levels(stack, executor, opts, report, section, levels, "submit_history")
    full_get = await throughput.get_task(stack, executor, opts, report, section, "get_history")
    for level in levels:
        ratio = _p99(full_submit[level]) / _p99(empty_submit[level])
        report.add(section, f"SubmitTask p99 vs empty table, {level} in flight", ratio, "x", at_most=1.2)
    for get_level, empty in empty_get.items():
        ratio = _p99(full_get[get_level]) / _p99(empty)
        report.add(section, f"GetTask p99 vs empty table, {get_level} in flight", ratio, "x", at_most=1.1)
    await backlog(stack, executor, opts, report, rows, empty_get)


async def backlog(
    stack: BenchStack, executor: ProcessPoolExecutor, opts: throughput.Options, report: Report, after_id: int,
    empty_get: dict[int, LoadResult], rows: int = BACKLOG,
) -> None:
    """GetTask of QUEUED tasks with `rows` QUEUED tasks of the same tenant and level ahead of them (and the history
    still in the table), each p99 as a ratio of the empty table's."""
    section = f"with {rows:,} QUEUED tasks ahead"
    began = time.monotonic()
    async with stack.db.acquire() as conn:
        await bench_store.insert_backlog(conn, rows=rows, tenant=TENANT, after_id=after_id)
    report.add(section, "bulk insert of the backlog (QUEUED tasks, ANALYZE)", time.monotonic() - began, "s")
    try:
        full_get = await throughput.get_task(stack, executor, opts, report, section, "get_backlog", close=False)
    finally:  # gone before the polled tasks are closed: cancelling them would be 100,000 events to relay
        async with stack.db.acquire() as conn:
            await bench_store.delete_backlog(conn, rows=rows, after_id=after_id)
        await stack.close_open_tasks()
    for get_level, empty in empty_get.items():
        ratio = _p99(full_get[get_level]) / _p99(empty)
        report.add(section, f"GetTask p99 vs empty table, {get_level} in flight", ratio, "x", at_most=1.1)
