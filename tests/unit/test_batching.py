"""The submit batcher without a database: what runs behind a batch in flight, callers that gave up, each caller's
deadline; the submit columns in the order the queries number them."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import grpc
import pytest

from services.submit.batching import Batcher
from taskgate import errors, sql
from taskgate.store import submissions


async def test_the_batcher_runs_everything_queued_behind_a_batch_in_flight() -> None:
    sizes: list[int] = []
    in_flight, release = asyncio.Event(), asyncio.Event()

    async def flush(items: list[int]) -> list[int | BaseException]:
        sizes.append(len(items))
        if items == [0]:
            in_flight.set()
            await release.wait()
        return [ValueError(i) if i == 3 else i * 10 for i in items]

    batcher: Batcher[int, int] = Batcher(flush, max_size=4)
    far = asyncio.get_running_loop().time() + 60
    lone = await batcher.run([7], far)  # a lone call goes at once
    assert lone == [70] and sizes == [1]
    sizes.clear()
    first = asyncio.create_task(batcher.run([0], far))
    await in_flight.wait()
    rest = [asyncio.create_task(batcher.run([i], far)) for i in range(1, 6)]
    await asyncio.sleep(0)  # one turn of the loop: the five calls queue
    release.set()
    assert await first == [0]
    results = [await r for r in rest]
    assert sizes == [1, 4, 1]  # everything that queued meanwhile, at most max_size per batch
    assert results[:2] == [[10], [20]] and isinstance(results[2][0], ValueError) and results[3:] == [[40], [50]]


async def test_a_caller_that_gave_up_is_left_out_of_the_next_batch() -> None:
    seen, in_flight, release, batcher = _first_batch_held()
    far = asyncio.get_running_loop().time() + 60
    first = asyncio.create_task(batcher.run([1], far))
    await in_flight.wait()
    gone = asyncio.create_task(batcher.run([2], far))
    kept = asyncio.create_task(batcher.run([3], far))
    await asyncio.sleep(0)  # one turn of the loop: both calls queue
    gone.cancel()
    with pytest.raises(asyncio.CancelledError):
        await gone
    release.set()
    assert await first == [1] and await kept == [3]
    assert seen == [[1], [3]]


async def test_deadlines_are_each_callers_own() -> None:
    seen, in_flight, release, batcher = _first_batch_held()
    loop = asyncio.get_running_loop()
    far = loop.time() + 60
    slow = asyncio.create_task(batcher.run([1], far))
    hasty = asyncio.create_task(batcher.run([2], loop.time() + 0.05))  # leaves while the batch ahead of it runs
    await in_flight.wait()
    late = asyncio.create_task(batcher.run([3], loop.time() + 0.05))  # its deadline passes before its batch begins
    kept = asyncio.create_task(batcher.run([4], far))
    with pytest.raises(errors.ApiError) as left:
        await hasty
    assert left.value.code == grpc.StatusCode.DEADLINE_EXCEEDED and not slow.done()  # the batch ran on without it
    with pytest.raises(errors.ApiError):
        await late
    release.set()
    assert await slow == [1] and await kept == [4]
    assert seen == [[1, 2], [4]]  # the late caller never joined a batch; the hasty one's batch was not cut short


def test_the_submit_columns_are_named_in_the_order_the_queries_number_them() -> None:
    for name in ("submit_insert_tasks", "admin_replay_tasks"):
        named = re.findall(r"p_(\w+) => \$(\d+)", sql.query(name))
        assert [column for column, _ in named][: len(submissions.COLUMNS)] == list(submissions.COLUMNS), name
        assert [int(n) for _, n in named] == list(range(1, len(named) + 1)), name


def _first_batch_held() -> tuple[list[list[int]], asyncio.Event, asyncio.Event, Batcher[int, int]]:
    """A batcher echoing its items whose first batch waits for `release` (`in_flight` set meanwhile); `seen` holds
    each batch's items."""
    seen: list[list[int]] = []
    in_flight, release = asyncio.Event(), asyncio.Event()

    async def flush(items: list[int]) -> list[int | BaseException]:
        seen.append(items)
        if len(seen) == 1:
            in_flight.set()
            await release.wait()
        return list(items)

    return seen, in_flight, release, Batcher(flush, max_size=10)


def test_an_admission_row_has_exactly_the_fields_submit_tasks_reads() -> None:
    migration = (Path(sql.__file__).parent / "migrations" / "0039_admission_rows.sql").read_text()
    declared = re.search(r"CREATE TYPE admission_item AS \((.*?)\);", migration, re.S)
    assert declared is not None
    fields = [
        line.split()[0] for line in declared.group(1).splitlines() if line.strip() and not line.strip().startswith("--")
    ]
    for later in sorted((Path(sql.__file__).parent / "migrations").glob("*.sql")):  # attributes added since
        fields += re.findall(r"ALTER TYPE admission_item ADD ATTRIBUTE (\w+)", later.read_text())
    new = submissions.NewTask(
        id=1,
        user_id="t",
        idempotency_key="k",
        key_derived=False,
        request_hash="h",
        task_type="text-to-video",
        model_id="m",
        prompt="p",
        payload={},
        metadata={},
        priority=5,
        max_retries=0,
        callback_url=None,
        callback_events=[],
    )
    [row] = submissions.admission_rows([submissions.Candidate(new, 10, 1.5)])
    assert sorted(row) == sorted(fields)


def test_the_queued_move_copies_the_callers_row_field_by_field() -> None:
    """queue_created answers with copies of the caller's rows (TaskRow(*_ALL_FIELDS(row))): equal, not the same object,
    so setting the move's columns on the copy leaves the row that answers the submission as it was."""
    from datetime import UTC, datetime

    from taskgate.model import TaskRow
    from taskgate.states import Status

    now = datetime.now(UTC)
    row = TaskRow(
        id=7,
        user_id="t",
        idempotency_key="k",
        request_hash="h",
        task_type="text-to-video",
        model_id="m",
        prompt="p",
        request_payload={"seed": 1},
        priority=1,
        queue_name="q",
        status=Status.CREATED,
        progress=0,
        version=1,
        attempt=0,
        retry_count=0,
        max_retries=3,
        created_at=now,
        updated_at=now,
        metadata={"a": "b"},
        end_user="e",
        last_reason="r",
    )
    copy = TaskRow(*submissions._ALL_FIELDS(row))
    assert copy == row and copy is not row
    copy.status, copy.version = Status.QUEUED, 2
    assert row.status is Status.CREATED and row.version == 1
