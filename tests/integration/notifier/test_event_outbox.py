"""The event log is append-only for the relay (real PostgreSQL): events wait in an outbox the relay deletes from, each
pass appends one row, and a stream resuming from a cursor still finds an event whose id committed out of order."""

from __future__ import annotations

import asyncpg

from taskgate import sql, store
from taskgate.runtime import Backends
from taskgate.store import events as event_store
from tests.support.factories import insert_task
from tests.support.harness import plan_nodes


async def _relay_pass(pool: asyncpg.Pool) -> list[int]:
    """One relay pass as the notifier's relay runs it (without the publish): the ids it took and recorded."""
    async with pool.acquire() as conn, conn.transaction():
        at, rows = await event_store.lock_and_take(conn, limit=100)
        assert at is not None
        ids = [r.event.id for r in rows]
        if ids:
            await event_store.mark_published(conn, ids, at=at)
    return ids


async def test_a_pass_deletes_from_the_outbox_and_appends_one_row_leaving_the_events_as_written(
    backends: Backends,
) -> None:
    pool = backends.pool
    tasks = [await insert_task(pool) for _ in range(3)]
    before = [tuple(r) for r in await pool.fetch("SELECT * FROM task_event ORDER BY id")]
    assert await pool.fetchval("SELECT count(*) FROM event_outbox") == 3
    relayed = await _relay_pass(pool)
    assert len(relayed) == 3 and await pool.fetchval("SELECT count(*) FROM event_outbox") == 0
    assert [tuple(r) for r in await pool.fetch("SELECT * FROM task_event ORDER BY id")] == before  # untouched
    [(first, last)] = await pool.fetch("SELECT first_event, last_event FROM relay_pass")
    assert (first, last) == (min(relayed), max(relayed))
    assert await _relay_pass(pool) == [] and await pool.fetchval("SELECT count(*) FROM relay_pass") == 1
    assert {t.id for t in tasks} == {r[0] for r in await pool.fetch("SELECT task_id FROM task_event")}


async def test_a_cursor_after_an_out_of_order_commit_still_finds_the_earlier_id(backends: Backends) -> None:
    pool = backends.pool
    early, late, old = [await insert_task(pool) for _ in range(3)]
    await _relay_pass(pool)
    old_event = await pool.fetchval("SELECT max(id) FROM task_event WHERE task_id = $1", old.id)

    slow = await pool.acquire()
    try:
        tx = slow.transaction()
        await tx.start()
        await store.queue(slow, early.id, actor="test", expected_version=early.version)  # its event id comes first
        await store.queue(pool, late.id, actor="test", expected_version=late.version)  # ...but commits first
        cursor = (await _relay_pass(pool))[-1]  # a subscriber saw `late`'s event: its cursor
        await tx.commit()
    finally:
        await pool.release(slow)
    early_event = await pool.fetchval("SELECT max(id) FROM task_event WHERE task_id = $1", early.id)
    assert early_event < cursor  # the earlier id, relayed in a later pass
    assert await _relay_pass(pool) == [early_event]

    relayed_at = await event_store.relayed_at(pool, event_id=cursor, user_id="tenant-a")
    assert relayed_at is not None
    back = [
        e.id for e in await event_store.user_events_lookback(pool, "tenant-a", cursor=cursor, relayed_at=relayed_at)
    ]
    assert early_event in back and cursor in back and old_event not in back
    # an event still in the outbox is not yet relayed: no relay time, and the lookback offers what is still to come
    waiting = await insert_task(pool)
    waiting_event = await pool.fetchval("SELECT max(id) FROM task_event WHERE task_id = $1", waiting.id)
    assert await event_store.relayed_at(pool, event_id=waiting_event, user_id="tenant-a") is None
    assert await event_store.relayed_at(pool, event_id=cursor, user_id="another-tenant") is None


async def test_the_lock_and_the_take_are_one_statement_that_takes_nothing_without_the_lock(backends: Backends) -> None:
    pool = backends.pool
    tasks = [await insert_task(pool) for _ in range(3)]
    async with pool.acquire() as holder, holder.transaction():
        assert await event_store.lock_relay(holder) is not None  # another replica's pass holds the lock
        async with pool.acquire() as conn, conn.transaction():
            assert await event_store.lock_and_take(conn, limit=100) == (None, [])
            # ...and locked none of the outbox: the holder's pass takes every event
            taken = await event_store.take_unpublished(holder, limit=100)
            assert {r.event.task_id for r in taken} == {t.id for t in tasks}
    async with pool.acquire() as conn, conn.transaction():
        at, rows = await event_store.lock_and_take(conn, limit=2)
        assert at is not None and [r.event.task_id for r in rows] == [t.id for t in tasks[:2]]
        assert rows[0].event.id < rows[1].event.id and rows[0].callback_url is None
    await _relay_pass(pool)
    async with pool.acquire() as conn, conn.transaction():
        at, rows = await event_store.lock_and_take(conn, limit=100)
        assert at is not None and rows == []  # the lock, and an empty outbox


async def test_a_pass_reads_events_and_tasks_by_key_whatever_plan_the_cache_keeps(backends: Backends) -> None:
    """The relay's statement runs on every pass, so the plan cache soon keeps a generic plan, which cannot see the
    limit (it guesses a tenth of the outbox): as plain joins that plan hash-joined a sequential scan of task_event and
    of task on every pass once the outbox held a backlog (#38). Under a forced generic plan, with 20,000 events waiting,
    each is still read by its primary key only."""
    pool = backends.pool
    async with pool.acquire() as conn:
        await conn.execute("ALTER TABLE task DISABLE TRIGGER task_event_on_insert")  # history written below instead
        await conn.execute(
            "INSERT INTO task (id, user_id, idempotency_key, request_hash, task_type, model_id, prompt,"
            " request_payload, priority, queue_name) SELECT i, 'tenant-a', 'k-' || i, 'h', 'text-to-video', 'wan-tiny',"
            " 'p', '{}', 5, 'q' FROM generate_series(1, 20000) i"
        )
        await conn.execute("ALTER TABLE task ENABLE TRIGGER task_event_on_insert")
        await conn.execute(
            "INSERT INTO task_event (task_id, user_id, model_id, version, to_status, actor, progress, attempt)"
            " SELECT i, 'tenant-a', 'wan-tiny', 1, 'CREATED', 'test', 0, 0 FROM generate_series(1, 20000) i"
        )
        await conn.execute("INSERT INTO event_outbox (event_id) SELECT id FROM task_event")  # a relay fallen behind
        await conn.execute("ANALYZE task; ANALYZE task_event; ANALYZE event_outbox")
        for name, args in (("relay_lock_take", "(1, 100)"), ("relay_take_events", "(100)")):
            async with conn.transaction():
                await conn.execute("SET LOCAL plan_cache_mode = force_generic_plan")
                types = "(bigint, integer)" if name == "relay_lock_take" else "(integer)"
                await conn.execute(f"PREPARE relay_read {types} AS {sql.query(name)}")
                [explained] = await conn.fetchval(f"EXPLAIN (FORMAT JSON) EXECUTE relay_read {args}")
                await conn.execute("DEALLOCATE relay_read")
            nodes = plan_nodes(explained["Plan"])
            scans = {(n["Node Type"], n.get("Relation Name")) for n in nodes if n.get("Relation Name")}
            assert ("Seq Scan", "task") not in scans and ("Seq Scan", "task_event") not in scans, (name, scans)
            assert {("Index Scan", "task"), ("Index Scan", "task_event")} <= scans, (name, scans)
        async with conn.transaction():  # and the pass itself: the oldest 100, each with its task
            at, rows = await event_store.lock_and_take(conn, limit=100)
            assert at is not None and [r.event.task_id for r in rows] == list(range(1, 101))
