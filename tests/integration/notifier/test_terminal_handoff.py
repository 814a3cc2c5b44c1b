"""Events straight to watchers: a statement of few events NOTIFYs each row as written when its transaction commits
(functions/task_history.sql), and the notifier hands it to the task's WatchTask streams without a read and without
waiting for the relay; the relay stays the way every event reaches every stream, each stream dropping the copy that
comes second."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence
from datetime import datetime
from typing import Any

import asyncpg
import grpc
import pytest

from services.notifier import committed, shared_reads
from services.notifier.relay import TestSignals
from taskgate import store
from taskgate.config import Settings
from taskgate.runtime import Backends
from taskgate.states import Status
from taskgate_api.v1 import events_pb2, task_pb2
from tests.support.factories import claimed, insert_task, sleepy_settings, submit
from tests.support.harness import bearer
from tests.support.notifier import all_relayed, events_stub, fast

TERMINAL = {task_pb2.TASK_STATUS_SUCCEEDED, task_pb2.TASK_STATUS_FAILED, task_pb2.TASK_STATUS_CANCELED}


async def _follow(stub: Any, task_id: int, api_key: str) -> list[tuple[int, int]]:
    """(version, status) of the snapshot and each event of one WatchTask stream, until its terminal one."""
    seen: list[tuple[int, int]] = []
    call = stub.WatchTask(events_pb2.WatchTaskRequest(task_id=str(task_id)),
                          metadata=(("authorization", f"Bearer {api_key}"),))
    async for item in call:
        if item.HasField("snapshot"):
            seen.append((item.snapshot.version, item.snapshot.status))
        elif item.HasField("event"):
            seen.append((item.event.version, item.event.to_status))
        if seen and seen[-1][1] in TERMINAL:
            return seen
    return seen


def _stuck_relay() -> tuple[asyncio.Event, TestSignals]:
    stuck = asyncio.Event()

    async def never_commits(_ids: Sequence[int]) -> None:
        stuck.set()
        await asyncio.Event().wait()  # the relay's pass hangs: nothing reaches the JetStream feed

    return stuck, TestSignals(before_commit=never_commits)


async def test_the_end_reaches_a_watchtask_stream_while_the_relay_is_stuck_and_the_notifier_reads_nothing(
    backends: Backends, settings: Settings, notifier_factory: Any, workers: Any, api_key: str
) -> None:
    """Every version after the snapshot, the end included, reaches the stream with the relay's pass hung and every
    connection of the notifier's pools held (no read of the table can run): each came in its commit's NOTIFY. With
    the ended hints this replaced (a NATS message naming the version, read from the table) nothing arrived."""
    stuck, signals = _stuck_relay()
    # a keep-alive period far beyond the test: the streams' quiet check of the table cannot be what delivers
    tuned = fast(settings, stream_keepalive_seconds=120.0)
    notifier = await notifier_factory(tuned.model_copy(update={"db_pool_size": 2}), own=True, signals=signals)
    task = await submit(backends)
    assert notifier.event_pool is not None
    held: list[tuple[asyncpg.Pool, Any]] = []
    async with events_stub(notifier) as stub:
        call = stub.WatchTask(events_pb2.WatchTaskRequest(task_id=str(task.id)), metadata=bearer(api_key))
        first = await asyncio.wait_for(call.read(), 20)
        assert first.WhichOneof("kind") == "snapshot"
        seen = [(first.snapshot.version, first.snapshot.status)]
        await asyncio.wait_for(stuck.wait(), 10)
        for pool in (notifier.backends.pool, notifier.event_pool):  # every connection not in use (the relay holds one)
            free = pool.get_max_size() - pool.get_size() + pool.get_idle_size()
            held += [(pool, await pool.acquire(timeout=10)) for _ in range(free)]
            assert pool.get_idle_size() == 0 and pool.get_size() == pool.get_max_size()
        try:
            await workers(sleepy_settings(tuned, sleep=0.3))

            async def until_terminal() -> None:
                while (item := await call.read()) is not grpc.aio.EOF:
                    if item.HasField("event"):
                        seen.append((item.event.version, item.event.to_status))
                        if item.event.to_status in TERMINAL:
                            return

            await asyncio.wait_for(until_terminal(), 20)
        finally:
            for pool, conn in held:
                await pool.release(conn)
    rows = await backends.pool.fetch(
        "SELECT version, to_status::text AS s FROM task_event WHERE task_id = $1 ORDER BY version", task.id
    )
    assert rows[-1]["s"] == "SUCCEEDED"
    versions = [v for v, _ in seen]
    assert versions == list(range(versions[0], rows[-1]["version"] + 1)), seen  # every version once, in order
    assert seen[-1][1] == task_pb2.TASK_STATUS_SUCCEEDED
    assert await backends.pool.fetchval("SELECT count(*) FROM event_outbox") > 0  # the relay really published nothing


async def test_a_notification_is_the_committed_row_and_only_a_committed_one(backends: Backends) -> None:
    """The payload is the event's row as written (its id and time included: what the relay would send); a statement
    rolled back sends nothing, a statement of many events sends none, and a row too long for a payload is named by
    its task and version (a longer payload would fail the move itself)."""
    pool = backends.pool
    got: asyncio.Queue[str] = asyncio.Queue()
    listening = await asyncpg.connect(backends.database_url)
    await listening.add_listener(committed.CHANNEL, lambda *args: got.put_nowait(args[3]))
    try:
        task = await insert_task(pool)
        async with pool.acquire() as conn:
            rollback = conn.transaction()
            await rollback.start()
            assert (await store.queue(conn, task.id, actor="test")).applied
            await rollback.rollback()
        assert (await store.queue(pool, task.id, actor="test")).applied
        body = json.loads(await asyncio.wait_for(got.get(), 10))
        row = await pool.fetchrow("SELECT * FROM task_event WHERE task_id = $1 AND version = 2", task.id)
        assert body["id"] == row["id"] and body["version"] == 2 and body["to_status"] == "QUEUED"
        assert datetime.fromisoformat(body["at"]) == row["at"]

        many = [await insert_task(pool) for _ in range(17)]
        await pool.execute(
            "UPDATE task SET status = 'CANCELED', version = version + 1, finished_at = now(), updated_at = now()"
            " WHERE id = ANY($1::bigint[])", [t.id for t in many]
        )
        assert await pool.fetchval("SELECT count(*) FROM task_event WHERE to_status = 'CANCELED'") == 17

        await claimed(pool, task.id)
        long = "x" * 10_000
        failed = await store.fail(
            pool, task.id, error=store.TaskError("BIG", long), actor="test", reason="too long", attempt=1
        )
        assert failed.applied  # the move is not refused for its payload's length
        bodies = [json.loads(await asyncio.wait_for(got.get(), 10)) for _ in range(2)]
        assert [b.get("to_status") for b in bodies] == ["PROCESSING", None]  # the 17 cancels sent nothing
        assert bodies[1] == {"task_id": task.id, "version": failed.task.version if failed.task else 0}
        assert got.empty()  # the rolled-back move sent nothing either
    finally:
        await listening.close()


async def test_with_the_relay_running_each_version_arrives_once(
    backends: Backends, settings: Settings, notifier_factory: Any, workers: Any, api_key: str
) -> None:
    notifier = await notifier_factory(fast(settings))
    await workers(sleepy_settings(settings, sleep=0.3))
    for _ in range(3):
        task = await submit(backends)
        async with events_stub(notifier) as stub:
            seen = await asyncio.wait_for(_follow(stub, task.id, api_key), 20)
        versions = [v for v, _ in seen]
        assert versions == sorted(set(versions)) and versions == list(range(versions[0], versions[-1] + 1)), seen
        assert seen[-1][1] == task_pb2.TASK_STATUS_SUCCEEDED


BURST = 50


async def test_a_burst_of_terminal_events_reaches_every_stream_while_the_streams_reads_hold_the_pool(
    backends: Backends, settings: Settings, notifier_factory: Any, api_key: str
) -> None:
    """The streams benchmark: 10,000 WatchTask streams opening (each reads its row, its ETA, its history) hold every
    connection of the notifier's pool with more reads queued, and a burst of 1,000 terminal events reached 314 (then
    0) of its streams in 30 s: the relay's pass and the hints' reads waited in that queue, and each quiet stream sat in
    its keep-alive's read of the table with its terminal event buffered behind it. Here the pool is held outright."""
    pool = backends.pool
    # a keep-alive period well inside the test: every stream is in its quiet check when the burst comes
    tuned = fast(settings, db_pool_size=2, stream_keepalive_seconds=0.4)
    notifier = await notifier_factory(tuned, own=True)
    tasks = [await insert_task(pool) for _ in range(BURST)]
    await all_relayed(pool)
    received: dict[int, int] = {}
    async with events_stub(notifier) as stub:
        calls = {
            t.id: stub.WatchTask(events_pb2.WatchTaskRequest(task_id=str(t.id)), metadata=bearer(api_key))
            for t in tasks
        }
        for call in calls.values():
            assert (await asyncio.wait_for(call.read(), 20)).WhichOneof("kind") == "snapshot"

        async def until_terminal(task_id: int, call: Any) -> None:
            while (item := await call.read()) is not grpc.aio.EOF:
                if item.HasField("event") and item.event.to_status in TERMINAL:
                    received[task_id] = item.event.version
                    return

        held = [await notifier.backends.pool.acquire() for _ in range(2)]  # the streams' reads hold every connection
        try:
            await asyncio.sleep(1.0)  # streams go quiet and ask the table (a keep-alive period is 0.4 s)
            for task in tasks:
                assert (await store.apply(pool, task.id, store.Cancel(store.CancelMode.HARD), actor="test")).applied
            following = [asyncio.create_task(until_terminal(i, c)) for i, c in calls.items()]
            await asyncio.wait(following, timeout=15)
            for waiting in following:
                waiting.cancel()
        finally:
            for conn in held:
                await notifier.backends.pool.release(conn)
    assert len(received) == BURST, f"{len(received)} of {BURST} streams got their terminal event"


HELD_BURST = 1_000


async def test_a_burst_reaches_every_stream_while_its_previous_events_eta_read_is_slow(
    backends: Backends, settings: Settings, notifier_factory: Any, api_key: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The streams benchmark (10,000 WatchTask streams on queued tasks, a burst of 1,000 cancels): the scheduler's
    'queued too long' event (QUEUED -> QUEUED) reached every stream, and each waited for that event's ETA, one read
    for all of them that grew with the backlog and ran for minutes; the burst's terminal events sat buffered behind it
    (486 of 1,000 arrived in 30 s, at p50 33.8 s) and no stream got a keep-alive. Here that ETA read is held outright:
    a later event, the end, goes out all the same (the QUEUED event before it without its ETA)."""
    pool = backends.pool
    asked = asyncio.Event()
    never = asyncio.Event()  # the ETA read is not answered until the burst is checked

    async def held(_self: Any, seen: list[tuple[int, Status]]) -> list[Any]:
        asked.set()
        await never.wait()
        return [None] * len(seen)

    monkeypatch.setattr(shared_reads.Estimates, "_read_many", held)
    # a keep-alive period beyond the test: the quiet check cannot be what delivers; the stream limits lifted
    tuned = fast(
        settings, stream_keepalive_seconds=120.0, max_streams_per_tenant=HELD_BURST, tenant_calls_per_second=0.0
    )
    notifier = await notifier_factory(tuned)
    gate = asyncio.Semaphore(16)

    async def queued() -> int:
        async with gate:
            task = await insert_task(pool)
            assert (await store.queue(pool, task.id, actor="test")).applied
            return task.id

    ids = await asyncio.gather(*(queued() for _ in range(HELD_BURST)))
    await all_relayed(pool)
    received: dict[int, int] = {}
    async with events_stub(notifier) as stub:
        calls = {i: stub.WatchTask(events_pb2.WatchTaskRequest(task_id=str(i)), metadata=bearer(api_key)) for i in ids}
        for call in calls.values():
            assert (await asyncio.wait_for(call.read(), 30)).WhichOneof("kind") == "snapshot"

        async def until_terminal(task_id: int, call: Any) -> None:
            while (item := await call.read()) is not grpc.aio.EOF:
                if item.HasField("event") and item.event.to_status in TERMINAL:
                    received[task_id] = item.event.version
                    return

        following = [asyncio.create_task(until_terminal(i, c)) for i, c in calls.items()]
        try:
            async def changed(task_id: int, change: store.Change, actor: str) -> None:
                async with gate:
                    assert (await store.apply(pool, task_id, change, actor=actor)).applied

            # every stream gets a QUEUED event and asks for its ETA (one read for all of them, held)
            await asyncio.gather(*(changed(i, store.Republish(), "scheduler") for i in ids))
            await asyncio.wait_for(asked.wait(), 30)
            await asyncio.gather(*(changed(i, store.Cancel(store.CancelMode.HARD), "test") for i in ids))
            await asyncio.wait(following, timeout=30)
        finally:
            for waiting in following:
                waiting.cancel()
            never.set()
    assert len(received) == HELD_BURST, f"{len(received)} of {HELD_BURST} streams got their terminal event"
    assert set(received.values()) == {4}  # created 1, queued 2, re-published 3, canceled 4
