"""Retention against the real database and a real result store, with an injected clock: the scheduler deletes
finished tasks, events and attempt logs, stored outputs and reusable outputs once they expire, in bounded skip-locked
batches, logged and counted; `admin purge` (TaskAdmin.PurgeTasks, the SDK and the CLI) does it on demand."""

from __future__ import annotations

import asyncio
import json
import logging
import sys
from collections.abc import AsyncIterator
from datetime import datetime, timedelta
from pathlib import Path

import grpc
import pytest

from services.scheduler import service
from services.scheduler.retention import RetentionScan
from services.scheduler.scans import Action, ScanContext
from services.scheduler.service import Scheduler
from taskgate import auth, results, store, telemetry
from taskgate.config import Settings
from taskgate.model import TaskRow
from taskgate.results import FolderResults, ResultNotFound
from taskgate.runtime import Backends
from taskgate.states import Status
from taskgate_api import cli
from taskgate_client import connect_async
from tests.support.factories import Claim, all_settings, insert_task, moved, put_in
from tests.support.queries import db_now

DAY = 86400.0


@pytest.fixture
def settings(settings: Settings, tmp_path: Path) -> Settings:
    return settings.model_copy(
        update={
            "result_store": "fs",
            "result_dir": tmp_path / "results",
            "retain_tasks_seconds": 30 * DAY,
            "retain_events_seconds": 7 * DAY,
            "retain_results_seconds": 7 * DAY,
            "retain_reusable_seconds": 1 * DAY,
        }
    )


async def succeeded_with(backends: Backends, outputs: FolderResults, name: str, *, reuse: str | None = None) -> TaskRow:
    """A SUCCEEDED task whose output is a real file (or, with `reuse`, the given uri, as a reused output)."""
    task = await insert_task(backends.pool, prompt=f"prompt {name}")
    uri = reuse or (await outputs.put(name, f"bytes of {name}".encode(), "video/mp4")).uri
    result = store.ResultRef(uri, "video/mp4", 1, "ab" * 32, reused=reuse is not None)
    for change in (store.Queue(), Claim("w1", 10.0), store.Succeed(result)):
        out = await moved(backends.pool, task.id, change)
        assert out.applied and out.task is not None
        task = out.task
    return task


async def stored(outputs: FolderResults, uri: str) -> bool:
    try:
        async for _ in outputs.read(uri):
            return True
    except ResultNotFound:
        return False
    return True


async def counts(backends: Backends, task_id: int) -> tuple[int, int, int]:
    """(task rows, events, webhook attempt logs) of one task."""
    pool = backends.pool
    return (
        await pool.fetchval("SELECT count(*) FROM task WHERE id = $1", task_id),
        await pool.fetchval("SELECT count(*) FROM task_event WHERE task_id = $1", task_id),
        await pool.fetchval(
            "SELECT count(*) FROM callback_attempt a JOIN callback_delivery d ON d.id = a.delivery_id WHERE d.task_id "
            "= $1",
            task_id,
        ),
    )


async def with_webhook_log(backends: Backends, task: TaskRow) -> None:
    """A delivered webhook of the task's terminal event with one attempt logged (as the notifier writes them)."""
    async with backends.pool.acquire() as conn:
        await conn.execute(
            "DELETE FROM event_outbox o USING task_event e WHERE e.id = o.event_id AND e.task_id = $1", task.id
        )
        delivery = await conn.fetchval(
            "INSERT INTO callback_delivery (task_id, event_id, user_id, webhook_id, event_type, url, payload, status, "
            "attempts, delivered_at) SELECT task_id, max(id), 'tenant-a', 'msg_' || task_id, 'task.succeeded', "
            "'http://127.0.0.1/hook', '{}', 'DELIVERED', 1, now() FROM task_event WHERE task_id = $1 GROUP BY task_id "
            "RETURNING id",
            task.id,
        )
        await conn.execute(
            "INSERT INTO callback_attempt (delivery_id, attempt, webhook_id, status_code, latency_ms) "
            "VALUES ($1, 1, 'msg_x', 200, 1.0)",
            delivery,
        )


async def test_each_kind_goes_when_its_retention_ends_and_shared_outputs_go_with_their_last_reference(
    backends: Backends, settings: Settings, caplog: pytest.LogCaptureFixture
) -> None:
    outputs = FolderResults(settings.result_dir or Path())
    scan = RetentionScan(ScanContext(settings, backends.pool, backends.bus))
    mine = await succeeded_with(backends, outputs, "a.mp4")
    kept = (await outputs.put("r.mp4", b"soft-cancelled run", "video/mp4")).uri
    reused = await succeeded_with(backends, outputs, "b.mp4", reuse=kept)
    await backends.pool.execute(
        "INSERT INTO reusable_result (user_id, request_hash, source_task_id, result_uri, result_content_type, "
        "result_size, result_sha256) VALUES ($1, $2, 1, $3, 'video/mp4', 1, $4)",
        reused.user_id, reused.request_hash, kept, "cd" * 32,
    )
    waiting = await put_in(backends.pool, Status.QUEUED)
    await with_webhook_log(backends, mine)
    await with_webhook_log(backends, reused)
    t0 = await db_now(backends.pool)

    def at(days: float) -> datetime:
        return t0 + timedelta(days=days)

    nothing = await scan.run(at(0.5))
    assert not any(nothing.actions.values())

    # day 2: the reusable output is forgotten, but a task still refers to its file
    day2 = await scan.run(at(2))
    assert (day2.actions[Action.PURGE_REUSABLE], day2.actions[Action.PURGE_RESULT]) == (1, 0)
    assert await stored(outputs, kept)

    # day 8: both outputs go from the store (the shared one with its last reference), and the finished tasks' events
    # with their webhook logs; the rows stay, marked, and the unfinished task keeps its history
    with caplog.at_level(logging.INFO, logger="taskgate.scheduler"):
        day8 = await scan.run(at(8))
    assert day8.actions[Action.PURGE_RESULT] == 2 and day8.actions[Action.PURGE_EVENT] == 8
    assert not await stored(outputs, mine.result_uri or "") and not await stored(outputs, kept)
    assert await counts(backends, mine.id) == (1, 0, 0) and await counts(backends, reused.id) == (1, 0, 0)
    assert (await counts(backends, waiting.id))[1] == 2
    marked = await store.get_task(backends.pool, mine.id)
    assert marked is not None and marked.result_expired_at is not None
    assert marked.to_proto().result.HasField("deleted_at")
    assert any(r.getMessage() == "retention purge" for r in caplog.records)

    # day 31: the finished tasks go; the unfinished one stays whatever its age
    day31 = await scan.run(at(31))
    assert day31.actions[Action.PURGE_TASK] == 2 and day31.actions[Action.PURGE_RESULT] == 0
    assert await counts(backends, mine.id) == (0, 0, 0) and await counts(backends, reused.id) == (0, 0, 0)
    assert (await counts(backends, waiting.id))[0] == 1


async def test_an_output_kept_in_its_row_is_deleted_from_the_row_and_its_events_when_its_retention_ends(
    backends: Backends, settings: Settings
) -> None:
    """A small output is written into the row by the terminal commit (results.inline): its retention deletes its
    bytes from the task and from the SUCCEEDED event, keeping the media type."""
    task = await insert_task(backends.pool, prompt="inline")
    kept = results.inline(b'{"answer": 42}', "application/json")
    result = store.ResultRef(kept.uri, kept.content_type, kept.size, kept.sha256)
    for change in (store.Queue(), Claim("w1", 10.0), store.Succeed(result)):
        assert (await moved(backends.pool, task.id, change)).applied
    outputs = FolderResults(settings.result_dir or Path())
    assert b"".join([c async for c in outputs.read(kept.uri)]) == b'{"answer": 42}'  # any store reads it back
    results_sooner = settings.model_copy(update={"retain_results_seconds": 1 * DAY})  # than the events (7 days)
    scan = RetentionScan(ScanContext(results_sooner, backends.pool, backends.bus))
    report = await scan.run(await db_now(backends.pool) + timedelta(days=2))
    assert report.actions[Action.PURGE_RESULT] == 1 and report.actions[Action.PURGE_EVENT] == 0
    row = await store.get_task(backends.pool, task.id)
    assert row is not None and row.result_expired_at is not None and row.result_uri == "data:application/json;base64,"
    uris = await backends.pool.fetch("SELECT result_uri FROM task_event WHERE task_id = $1", task.id)
    assert [r[0] for r in uris if r[0]] == ["data:application/json;base64,"]


async def test_a_task_deleted_with_its_output_still_kept_takes_it_along(backends: Backends, settings: Settings) -> None:
    outputs = FolderResults(settings.result_dir or Path())
    only_tasks = settings.model_copy(update={"retain_results_seconds": 0.0, "retain_events_seconds": 0.0})
    scan = RetentionScan(ScanContext(only_tasks, backends.pool, backends.bus))
    task = await succeeded_with(backends, outputs, "c.mp4")
    # an output of another store (written before a switch of TASKGATE_RESULT_STORE): its row still goes
    foreign = await succeeded_with(backends, outputs, "d.mp4", reuse="nats-os://taskgate-results/d.mp4")
    t0 = await db_now(backends.pool)
    done = await scan.run(t0 + timedelta(days=31))
    assert (done.actions[Action.PURGE_TASK], done.actions[Action.PURGE_RESULT]) == (2, 1)
    assert not await stored(outputs, task.result_uri or "")
    assert await counts(backends, foreign.id) == (0, 0, 0)


async def test_batches_are_bounded_skip_locked_rows_and_counted(backends: Backends, settings: Settings) -> None:
    small = settings.model_copy(update={"scan_batch_size": 2})
    tasks = [await put_in(backends.pool, Status.FAILED) for _ in range(5)]
    later = await db_now(backends.pool) + timedelta(days=31)
    scheduler = Scheduler(small, backends.pool, backends.bus)
    before = telemetry.SCHEDULER_ACTIONS.labels(Action.PURGE_TASK.value)._value.get()
    async with backends.pool.acquire() as holder, holder.transaction():
        await holder.execute("SELECT 1 FROM task WHERE id = $1 FOR UPDATE", tasks[0].id)  # another replica's row
        first = await scheduler.retention.run(later)
        assert first.actions[Action.PURGE_TASK] == 2 and first.examined == 2  # a full batch: another pass follows
        assert await backends.pool.fetchval("SELECT count(*) FROM task WHERE id = $1", tasks[0].id) == 1
    passes = [await scheduler.run_once(later) for _ in range(3)]
    assert [p[Action.PURGE_TASK] for p in passes] == [2, 1, 0]
    assert passes[0].full and not passes[2].full
    assert await backends.pool.fetchval("SELECT count(*) FROM task") == 0
    assert telemetry.SCHEDULER_ACTIONS.labels(Action.PURGE_TASK.value)._value.get() - before == 3  # run_once counts


@pytest.fixture
async def admin_key(backends: Backends) -> AsyncIterator[tuple[str, int]]:
    handle = await service.start(all_settings(backends), backends, scan_loop=False)
    key, _ = await auth.create_key(backends.pool, backends.settings.api_key_pepper, "ops", admin=True)
    try:
        yield key, handle.port
    finally:
        await handle.stop()


async def test_admin_purge_dry_run_counts_then_deletes_through_the_sdk_and_the_cli(
    backends: Backends, settings: Settings, admin_key: tuple[str, int], tmp_path: Path
) -> None:
    key, port = admin_key
    outputs = FolderResults(settings.result_dir or Path())
    old = [await succeeded_with(backends, outputs, f"old{i}.mp4") for i in range(3)]
    fresh = await put_in(backends.pool, Status.FAILED)
    await backends.pool.execute(
        "UPDATE task SET finished_at = finished_at - interval '2 days' WHERE id = ANY($1::bigint[])",
        [t.id for t in old],
    )
    async with connect_async(f"127.0.0.1:{port}", key, admin_address=f"127.0.0.1:{port}", admin_key=key) as client:
        would = await client.purge(DAY, dry_run=True)
        assert (would.tasks, would.results, would.reusable_results, would.dry_run) == (3, 3, 0, True)
        assert await backends.pool.fetchval("SELECT count(*) FROM task") == 4
        code, out = await _cli(["admin", "purge", "--older-than", "1d", "--dry-run", "--json"], port, key, tmp_path)
        assert code == 0 and json.loads(out)["tasks"] == 3, out

        code, out = await _cli(["admin", "purge", "--older-than", "36h"], port, key, tmp_path)
        assert code == 0 and "deleted: 3 finished task(s)" in out, out
        assert [r["id"] for r in await backends.pool.fetch("SELECT id FROM task")] == [fresh.id]
        assert not any([await stored(outputs, t.result_uri or "") for t in old])
        again = await client.purge(DAY)
        assert (again.tasks, again.results, again.dry_run) == (0, 0, False)
        with pytest.raises(Exception, match="older_than"):
            await client.purge(-1.0)


async def test_purge_keeps_finished_tasks_whose_webhook_is_owed_or_whose_attempt_still_runs_and_says_so(
    backends: Backends, settings: Settings, admin_key: tuple[str, int], tmp_path: Path
) -> None:
    key, port = admin_key
    pool = backends.pool
    hook = "http://127.0.0.1:9/hook"
    owed = await insert_task(pool, prompt="owed", callback_url=hook)  # its terminal webhook not delivered yet
    for change in (
        store.Queue(),
        Claim("w1", 10.0),
        store.Succeed(store.ResultRef("mem://o", "video/mp4", 1, "ab" * 32)),
    ):
        assert (await moved(pool, owed.id, change)).applied
    retrying = await insert_task(pool, prompt="retrying", callback_url=hook)  # a delivery still being retried
    assert (await store.cancel(pool, retrying.id, mode=store.CancelMode.HARD, actor="test")).applied
    await pool.execute("UPDATE task SET callback_status = 'DELIVERED' WHERE id = $1", retrying.id)
    await pool.execute(
        "INSERT INTO callback_delivery (task_id, event_id, user_id, webhook_id, event_type, url, payload, attempts) "
        "SELECT task_id, max(id), user_id, 'msg_r', 'task.progress', $2, '{}', 2 FROM task_event WHERE task_id = $1 "
        "GROUP BY task_id, user_id", retrying.id, hook,
    )
    running = await put_in(pool, Status.PROCESSING)  # soft-cancelled: its worker still runs the attempt
    assert (await store.cancel(pool, running.id, mode=store.CancelMode.SOFT, actor="test")).applied
    plain = await put_in(pool, Status.FAILED)
    everyone = [owed.id, retrying.id, running.id, plain.id]
    await pool.execute(
        "UPDATE task SET finished_at = finished_at - interval '2 days' WHERE id = ANY($1::bigint[])", everyone
    )

    async with connect_async(f"127.0.0.1:{port}", key, admin_address=f"127.0.0.1:{port}", admin_key=key) as client:
        would = await client.purge(DAY, dry_run=True)
        assert would.tasks == 1 and {k.reason: k.tasks for k in would.kept} == {
            "webhook_undelivered": 2, "attempt_running": 1
        }
        code, out = await _cli(["admin", "purge", "--older-than", "0", "--dry-run"], port, key, tmp_path)
        assert code == 0 and "would delete: 1 finished task(s)" in out, out
        assert "would keep: 2 finished task(s) (webhook not delivered yet)" in out, out
        assert "would keep: 1 finished task(s) (soft-cancelled, attempt still running)" in out, out

        code, out = await _cli(["admin", "purge", "--older-than", "0", "--json"], port, key, tmp_path)
        assert code == 0 and json.loads(out)["tasks"] == 1, out
        assert json.loads(out)["kept"] == {"webhook_undelivered": 2, "attempt_running": 1}, out
        assert sorted(r["id"] for r in await pool.fetch("SELECT id FROM task")) == sorted(everyone[:3])

        # the scheduler's own retention follows the same rule, the pending delivery's event included
        scan = RetentionScan(
            ScanContext(settings.model_copy(update={"retain_events_seconds": 1.0}), pool, backends.bus)
        )
        later = await scan.run(await db_now(pool) + timedelta(days=60))
        assert later.actions[Action.PURGE_TASK] == 0
        assert await pool.fetchval("SELECT count(*) FROM callback_delivery WHERE task_id = $1", retrying.id) == 1

        # once delivered and let go, they go
        await pool.execute(
            "UPDATE callback_delivery SET status = 'DELIVERED', delivered_at = now() WHERE task_id = $1", retrying.id
        )
        await pool.execute("UPDATE task SET callback_status = 'DELIVERED' WHERE id = $1", owed.id)
        assert await store.let_go(pool, running.id, attempt=1)
        done = await client.purge(0.0)
        assert (done.tasks, list(done.kept)) == (3, [])
        assert await pool.fetchval("SELECT count(*) FROM task") == 0


async def test_purge_needs_an_admin_key(backends: Backends, admin_key: tuple[str, int]) -> None:
    _, port = admin_key
    user, _ = await auth.create_key(backends.pool, backends.settings.api_key_pepper, "tenant-a")
    async with connect_async(f"127.0.0.1:{port}", user, admin_address=f"127.0.0.1:{port}", admin_key=user) as client:
        with pytest.raises(Exception) as caught:
            await client.purge(DAY)
    assert getattr(caught.value, "code", None) is grpc.StatusCode.PERMISSION_DENIED


async def _cli(argv: list[str], port: int, key: str, cwd: Path) -> tuple[int, str]:
    """The `taskgate` CLI as a user runs it (a subprocess); its exit code and output."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "taskgate_client.cli", *argv, "--admin-address", f"127.0.0.1:{port}", "--admin-key", key,
        "--address", f"127.0.0.1:{port}", cwd=cwd, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
    )
    out, _ = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode is not None
    return proc.returncode, out.decode()


def test_purge_ages_parse() -> None:
    assert [cli.age(t) for t in ("3600", "90m", "12h", "30d", "1.5h")] == [3600, 5400, 43200, 2592000, 5400]
    with pytest.raises(Exception, match="not an age"):
        cli.age("soon")
