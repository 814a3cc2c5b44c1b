"""The state machine: the Python table, the database's table, and the guarded transitions on real PostgreSQL."""

from __future__ import annotations

import asyncio
import itertools

import asyncpg
import pytest

from taskgate import states, store
from taskgate.runtime import Backends
from taskgate.states import Status
from taskgate.store import CancelMode, Move, Rejection, ResultRef, TaskError, apply, get_task
from taskgate.store.workers import Verdict
from tests.support.factories import CHANGES, Claim, Step, claim, claimed, insert_task, moved


async def test_database_enum_and_transition_table_match(backends: Backends) -> None:
    enum = await backends.pool.fetchval("SELECT enum_range(NULL::task_status)::text[]")
    assert list(enum) == [s.value for s in Status]
    rows = await backends.pool.fetch("SELECT from_status::text, to_status::text FROM task_transition")
    db_pairs = {(r[0], r[1]) for r in rows}
    py_pairs = {(src.value, dst.value) for src, dsts in states.LEGAL.items() for dst in dsts}
    assert db_pairs == py_pairs


async def _put_in(pool: asyncpg.Pool, status: Status) -> int:
    """A task driven to `status` through legal moves."""
    task = await insert_task(pool)
    path: dict[Status, list[Step]] = {
        Status.CREATED: [],
        Status.QUEUED: [store.Queue()],
        Status.PROCESSING: [store.Queue(), Claim("w1", 10.0)],
        Status.SUCCEEDED: [
            store.Queue(),
            Claim("w1", 10.0),
            store.Succeed(ResultRef("mem://x", "video/mp4", 10, "ab" * 32)),
        ],
        Status.FAILED: [store.Queue(), Claim("w1", 10.0), store.Fail(TaskError("E", "boom"))],
        Status.TIMEOUT: [store.Queue(), store.TimeOut(TaskError("QUEUE_TIMEOUT", "late"))],
        Status.CANCELED: [store.Cancel(CancelMode.SOFT)],
    }
    for change in path[status]:
        out = await moved(pool, task.id, change)
        assert out.applied, (status, change, out.rejection)
    return task.id




@pytest.mark.parametrize(("status", "move"), list(itertools.product(list(Status), list(Move))))
async def test_every_pair_is_applied_or_refused_by_the_table(backends: Backends, status: Status, move: Move) -> None:
    task_id = await _put_in(backends.pool, status)
    before = await get_task(backends.pool, task_id)
    assert before is not None and before.status is status
    out = await apply(backends.pool, task_id, CHANGES[move], actor="test")
    expected = status in move.sources
    assert out.applied is expected
    after = await get_task(backends.pool, task_id)
    assert after is not None
    if expected:
        assert after.status is move.target and after.version == before.version + 1
    else:
        assert out.rejection is Rejection.ILLEGAL
        assert after.version == before.version and after.status is status


async def test_the_database_refuses_an_illegal_move_even_without_the_guard(backends: Backends) -> None:
    task_id = await _put_in(backends.pool, Status.SUCCEEDED)
    with pytest.raises(asyncpg.CheckViolationError):
        await backends.pool.execute("UPDATE task SET status='QUEUED', version=version+1, finished_at=NULL WHERE id=$1",
                                    task_id)


async def test_stale_version_loses(backends: Backends) -> None:
    task = await insert_task(backends.pool)
    first = await store.queue(backends.pool, task.id, actor="t", expected_version=task.version)
    assert first.applied
    again = await store.republish(backends.pool, task.id, actor="t", expected_version=task.version)
    assert again.rejection is Rejection.STALE
    missing = await store.queue(backends.pool, 42, actor="t")
    assert missing.rejection is Rejection.NOT_FOUND and missing.task is None


@pytest.mark.parametrize("status", list(Status))
async def test_the_claim_takes_only_what_the_table_allows(backends: Backends, status: Status) -> None:
    task_id = await _put_in(backends.pool, status)
    before = await get_task(backends.pool, task_id)
    assert before is not None
    got = await claim(backends.pool, task_id, worker_id="w2", lease_seconds=10.0)
    # a claim of a PROCESSING task needs an expired lease; the lease here is live
    expected = status in (Status.CREATED, Status.QUEUED)
    assert states.is_legal(status, Status.PROCESSING) or not expected
    assert (got.verdict is Verdict.CLAIMED) is expected, got.verdict
    after = await get_task(backends.pool, task_id)
    assert after is not None
    if expected:
        assert (after.status, after.version, after.attempt) == (
            Status.PROCESSING,
            before.version + 1,
            before.attempt + 1,
        )
    else:
        assert got.verdict is (Verdict.REFUSED if status is Status.PROCESSING else Verdict.FINISHED)
        assert (after.version, after.status) == (before.version, status)


async def test_fifty_concurrent_claimers_one_winner(backends: Backends) -> None:
    task_id = await _put_in(backends.pool, Status.QUEUED)
    results = await asyncio.gather(
        *(claim(backends.pool, task_id, worker_id=f"w{i}", lease_seconds=10.0) for i in range(50))
    )
    winners = [r for r in results if r.verdict is Verdict.CLAIMED]
    assert len(winners) == 1
    assert {r.verdict for r in results if r is not winners[0]} <= {Verdict.BUSY, Verdict.REFUSED}
    row = await get_task(backends.pool, task_id)
    assert row is not None and row.attempt == 1 and row.worker_id == winners[0].task.worker_id  # type: ignore[union-attr]


async def test_stale_attempt_cannot_write(backends: Backends) -> None:
    task_id = await _put_in(backends.pool, Status.PROCESSING)
    await backends.pool.execute("UPDATE task SET lease_expires_at = now() - interval '1 second' WHERE id = $1", task_id)
    reclaimed = await claimed(backends.pool, task_id, worker_id="w-new", lease_seconds=10.0)
    assert reclaimed.attempt == 2
    late = await store.succeed(
        backends.pool, task_id, attempt=1, result=ResultRef("mem://old", "video/mp4", 1, "00" * 32), actor="worker"
    )
    assert late.rejection is Rejection.STALE
    row = await get_task(backends.pool, task_id)
    assert row is not None and row.status is Status.PROCESSING and row.result_uri is None


async def test_history_matches_transitions_one_to_one(backends: Backends) -> None:
    task_id = await _put_in(backends.pool, Status.SUCCEEDED)
    rows = await backends.pool.fetch(
        "SELECT version, from_status::text, to_status::text, actor FROM task_event WHERE task_id=$1 ORDER BY version",
        task_id,
    )
    assert [(r["version"], r["from_status"], r["to_status"]) for r in rows] == [
        (1, None, "CREATED"), (2, "CREATED", "QUEUED"), (3, "QUEUED", "PROCESSING"), (4, "PROCESSING", "SUCCEEDED"),
    ]
    # a write that does not change the version leaves no history
    await backends.pool.execute("UPDATE task SET callback_retry = callback_retry + 1 WHERE id = $1", task_id)
    assert await backends.pool.fetchval("SELECT count(*) FROM task_event WHERE task_id=$1", task_id) == 4
