"""TaskAdmin over real gRPC, PostgreSQL and NATS, and the repair tool on top of it."""

from __future__ import annotations

import io

import asyncpg
import grpc
import pytest
from google.protobuf.duration_pb2 import Duration

from services.scheduler.requeue import replay_of
from services.worker import service as worker_service
from taskgate import bus as busmod
from taskgate import ids, store
from taskgate.model import TaskRow
from taskgate.states import Status
from taskgate.store import admin as admin_store
from taskgate_api.v1 import admin_pb2, task_pb2
from taskgate_client.repair import repair
from tests.support.factories import all_settings, claimed, dead, insert_task, put_in, sleepy_settings
from tests.support.harness import wait_for
from tests.support.queries import dispatches, row
from tests.support.stacks import Admin

Metadata = tuple[tuple[str, str], ...]






async def requeue(a: Admin, **fields: object) -> list[admin_pb2.RequeueBatch]:
    return [b async for b in a.stub.RequeueTasks(admin_pb2.RequeueTasksRequest(**fields), metadata=a.admin)]  # type: ignore[arg-type]


async def versions(a: Admin) -> dict[int, int]:
    return {r["id"]: r["version"] for r in await a.backends.pool.fetch("SELECT id, version FROM task")}


async def test_admin_key_required(admin: Admin) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await admin.stub.GetStats(admin_pb2.GetStatsRequest())
    assert err.value.code() is grpc.StatusCode.UNAUTHENTICATED
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await admin.stub.GetStats(admin_pb2.GetStatsRequest(), metadata=admin.user)
    assert err.value.code() is grpc.StatusCode.PERMISSION_DENIED
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await admin.stub.GetStats(admin_pb2.GetStatsRequest(), metadata=(("authorization", "Bearer tg_nope"),))
    assert err.value.code() is grpc.StatusCode.UNAUTHENTICATED
    task = await put_in(admin.backends.pool, Status.QUEUED)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        async for _ in admin.stub.RequeueTasks(
            admin_pb2.RequeueTasksRequest(task_ids=[str(task.id)]), metadata=admin.user
        ):
            pass
    assert err.value.code() is grpc.StatusCode.PERMISSION_DENIED
    assert (await row(admin.backends.pool, task.id)).version == task.version


async def test_get_stats(admin: Admin) -> None:
    pool = admin.backends.pool
    await put_in(pool, Status.PROCESSING, model_id="sleepy", worker="w-live")
    await put_in(pool, Status.PROCESSING, model_id="wan-tiny", worker="w-live")
    await put_in(pool, Status.PROCESSING, model_id="wan-tiny", worker="w-dead")
    done = await put_in(pool, Status.SUCCEEDED, model_id="wan-tiny")
    for _ in range(2):  # after the claims: a claim takes its level's oldest QUEUED task
        await put_in(pool, Status.QUEUED, model_id="sleepy")
    await pool.execute("UPDATE task SET queued_at = now() - interval '90 seconds' WHERE status = 'QUEUED'")
    await pool.execute(
        "INSERT INTO worker (id, models, slots, device, last_heartbeat) VALUES "
        "('w-live', '{sleepy,wan-tiny}', 4, 'cpu', now()), ('w-dead', '{wan-tiny}', 1, 'cpu', now() - interval '60 "
        "seconds'), ('w-idle', '{wan-tiny}', 2, 'cpu', now())"
    )
    event_id = await pool.fetchval("SELECT max(id) FROM task_event WHERE task_id = $1", done.id)
    await pool.execute(
        "INSERT INTO callback_delivery (task_id, event_id, user_id, webhook_id, event_type, url, payload, status, "
        "delivered_at) VALUES ($1, $2, 'tenant-a', 'wh-1', 'task.succeeded', 'http://127.0.0.1/a', '{}', 'DELIVERED', "
        "now()), ($1, $2, 'tenant-a', 'wh-2', 'task.succeeded', 'http://127.0.0.1/b', '{}', 'FAILED', NULL)",
        done.id, event_id,
    )

    stats = await admin.stub.GetStats(admin_pb2.GetStatsRequest(), metadata=admin.admin)

    counts = {(c.model_id, Status.from_proto(c.status)): c.count for c in stats.counts}
    assert counts == {
        ("sleepy", Status.QUEUED): 2, ("sleepy", Status.PROCESSING): 1,
        ("wan-tiny", Status.PROCESSING): 2, ("wan-tiny", Status.SUCCEEDED): 1,
    }
    assert 90 <= stats.oldest_queued_age.ToTimedelta().total_seconds() < 120
    workers = {w.worker_id: (w.running, w.slots, w.alive) for w in stats.workers}
    assert workers == {"w-live": (2, 4, True), "w-dead": (1, 1, False), "w-idle": (0, 2, True)}
    assert (stats.capacity, stats.running) == (6, 3)  # the live workers' slots; every task under a live lease
    callbacks = {c.status: c.count for c in stats.callbacks}
    assert callbacks == {task_pb2.CALLBACK_STATUS_DELIVERED: 1, task_pb2.CALLBACK_STATUS_FAILED: 1}


async def test_list_tasks_filters_and_pages(admin: Admin) -> None:
    pool = admin.backends.pool
    queued = [await put_in(pool, Status.QUEUED) for _ in range(5)]
    await put_in(pool, Status.QUEUED, model_id="sleepy")
    await put_in(pool, Status.CREATED)
    old = {queued[1].id, queued[3].id}
    await pool.execute(
        "UPDATE task SET updated_at = now() - interval '2 hours' WHERE id = ANY($1::bigint[])", list(old)
    )

    seen: list[str] = []
    token, pages = "", 0
    while True:
        page = await admin.stub.ListTasks(
            admin_pb2.AdminListTasksRequest(
                filter=admin_pb2.TaskFilter(statuses=[task_pb2.TASK_STATUS_QUEUED], model_id="wan-tiny"), page_size=2,
                page_token=token,
            ),
            metadata=admin.admin,
        )
        pages += 1
        seen += [t.id for t in page.tasks]
        token = page.next_page_token
        if not token:
            break
    assert pages == 3 and sorted(seen) == sorted(str(t.id) for t in queued) and len(set(seen)) == 5
    assert set(seen[:2]) == {str(i) for i in old}  # least recently updated first

    aged = await admin.stub.ListTasks(
        admin_pb2.AdminListTasksRequest(filter=admin_pb2.TaskFilter(older_than=Duration(seconds=3600))),
        metadata=admin.admin,
    )
    assert {int(t.id) for t in aged.tasks} == old

    with pytest.raises(grpc.aio.AioRpcError) as err:
        await admin.stub.ListTasks(admin_pb2.AdminListTasksRequest(page_token="garbage!"), metadata=admin.admin)
    assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT


async def test_newest_first_pages_and_the_live_counts_by_priority(admin: Admin) -> None:
    """The dashboard's two reads: the latest failures first, and the unfinished tasks per model and priority."""
    pool = admin.backends.pool
    failed = [await put_in(pool, Status.FAILED) for _ in range(3)]
    done = await put_in(pool, Status.SUCCEEDED)
    await pool.execute("UPDATE task SET updated_at = now() - interval '1 hour' WHERE id = $1", failed[1].id)
    high = await insert_task(pool, model_id="sleepy", priority=10)
    await store.apply(pool, high.id, store.Queue(), actor="test")
    await insert_task(pool, model_id="sleepy", priority=1)
    await put_in(pool, Status.QUEUED, model_id="sleepy")
    await pool.execute(
        "INSERT INTO worker (id, models, slots, device, draining, last_heartbeat) VALUES ('w-gpu', '{sleepy}', 3, "
        "'cuda:0', true, now())"
    )

    seen: list[str] = []
    token = ""
    while True:
        page = await admin.stub.ListTasks(
            admin_pb2.AdminListTasksRequest(
                filter=admin_pb2.TaskFilter(statuses=[task_pb2.TASK_STATUS_FAILED, task_pb2.TASK_STATUS_SUCCEEDED]),
                page_size=2, page_token=token, newest_first=True,
            ),
            metadata=admin.admin,
        )
        seen += [t.id for t in page.tasks]
        if not (token := page.next_page_token):
            break
    assert seen == [str(t.id) for t in (done, failed[2], failed[0], failed[1])]  # most recently updated first
    everything = await admin.stub.ListTasks(admin_pb2.AdminListTasksRequest(newest_first=True), metadata=admin.admin)
    assert len(everything.tasks) == 7 and everything.tasks[-1].id == str(failed[1].id)
    first = await admin.stub.ListTasks(admin_pb2.AdminListTasksRequest(page_size=1), metadata=admin.admin)
    with pytest.raises(grpc.aio.AioRpcError) as err:  # a token of one order is no position in the other
        await admin.stub.ListTasks(
            admin_pb2.AdminListTasksRequest(page_size=1, page_token=first.next_page_token, newest_first=True),
            metadata=admin.admin,
        )
    assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT

    stats = await admin.stub.GetStats(admin_pb2.GetStatsRequest(), metadata=admin.admin)
    live = {(c.model_id, c.priority, Status.from_proto(c.status)): c.count for c in stats.live}
    assert live == {
        ("sleepy", task_pb2.PRIORITY_HIGH, Status.QUEUED): 1, ("sleepy", task_pb2.PRIORITY_NORMAL, Status.QUEUED): 1,
        ("sleepy", task_pb2.PRIORITY_LOW, Status.CREATED): 1,
    }
    assert all(c.priority == task_pb2.PRIORITY_UNSPECIFIED for c in stats.counts)  # as before: every priority together
    [worker] = stats.workers
    assert (worker.worker_id, worker.device, worker.draining, worker.slots) == ("w-gpu", "cuda:0", True, 3)


async def test_list_stuck_tasks_says_why_and_changes_nothing(admin: Admin) -> None:
    pool = admin.backends.pool
    created = await put_in(pool, Status.CREATED)
    await pool.execute("UPDATE task SET updated_at = now() - interval '31 seconds' WHERE id = $1", created.id)
    lost = await put_in(pool, Status.PROCESSING, lease=0.000001)
    await put_in(pool, Status.PROCESSING)  # live lease: not stuck
    await put_in(pool, Status.QUEUED)  # fresh: not stuck
    before = await versions(admin)

    stuck = await admin.stub.ListStuckTasks(admin_pb2.ListStuckTasksRequest(), metadata=admin.admin)

    assert {(int(s.task.id), s.reason) for s in stuck.tasks} == {
        (created.id, "CREATED_TOO_LONG"),
        (lost.id, "LEASE_EXPIRED"),
    }
    assert await versions(admin) == before
    limited = await admin.stub.ListStuckTasks(admin_pb2.ListStuckTasksRequest(limit=1), metadata=admin.admin)
    assert len(limited.tasks) == 1


async def _mixed(admin: Admin) -> tuple[list[int], set[int], set[int]]:
    """Tasks of every kind; returns (all ids incl. an unknown one, ids a requeue moves, ids it skips)."""
    pool = admin.backends.pool
    expired = [await put_in(pool, Status.PROCESSING, lease=0.000001) for _ in range(3)]
    live = await put_in(pool, Status.PROCESSING, worker="w-alive")
    finished = await put_in(pool, Status.SUCCEEDED)
    queued = [await put_in(pool, Status.QUEUED) for _ in range(2)]
    created = await put_in(pool, Status.CREATED)
    unknown = 4242
    movable = {t.id for t in [*expired, *queued, created]}
    skipped = {live.id, finished.id, unknown}
    return [*movable, *skipped], movable, skipped


async def test_requeue_dry_run_changes_nothing_and_reports_exactly_what_would_change(admin: Admin) -> None:
    ids, movable, skipped = await _mixed(admin)
    before = await versions(admin)

    [batch] = await requeue(admin, task_ids=[str(i) for i in ids], dry_run=True)

    assert batch.dry_run and batch.batch == 1
    by_action: dict[str, set[int]] = {}
    for item in batch.items:
        by_action.setdefault(item.action, set()).add(int(item.task_id))
    assert by_action == {"WOULD_REQUEUE": movable, "SKIPPED": skipped}
    assert await versions(admin) == before
    assert await dispatches(admin.backends.bus) == []

    [done] = await requeue(admin, task_ids=[str(i) for i in ids])
    requeued = {int(i.task_id) for i in done.items if i.action == "REQUEUED"}
    assert requeued == movable and not done.dry_run
    after = await versions(admin)
    assert all(after[i] == before[i] + 1 for i in movable)
    assert all(after[i] == before[i] for i in skipped if i in before)
    for task_id in movable:
        assert (await row(admin.backends.pool, task_id)).status is Status.QUEUED
    assert len(await dispatches(admin.backends.bus)) == len(movable)
    live = next(i for i in done.items if "alive" in i.detail)
    assert live.action == "SKIPPED" and (await row(admin.backends.pool, int(live.task_id))).status is Status.PROCESSING
    summary = {(c.model_id, Status.from_proto(c.status)): c.count for c in done.summary}
    assert summary == {("wan-tiny", Status.QUEUED): 6, ("wan-tiny", Status.PROCESSING): 1}


async def test_requeue_respects_batch_size(admin: Admin) -> None:
    pool = admin.backends.pool
    tasks = [await put_in(pool, Status.PROCESSING, lease=0.000001) for _ in range(7)]

    batches = await requeue(admin, task_ids=[str(t.id) for t in tasks], batch_size=3)

    assert [b.batch for b in batches] == [1, 2, 3] and [len(b.items) for b in batches] == [3, 3, 1]
    queued_after = [
        next(c.count for c in b.summary if Status.from_proto(c.status) is Status.QUEUED) for b in batches
    ]
    assert queued_after == [3, 6, 7]  # the summary is taken after each batch


async def test_requeue_by_filter_uses_the_default_batch_of_50(admin: Admin) -> None:
    pool = admin.backends.pool
    sleepy = [await put_in(pool, Status.QUEUED, model_id="sleepy") for _ in range(53)]
    other = await put_in(pool, Status.QUEUED, model_id="wan-tiny")

    batches = await requeue(
        admin, filter=admin_pb2.TaskFilter(statuses=[task_pb2.TASK_STATUS_QUEUED], model_id="sleepy")
    )

    assert [len(b.items) for b in batches] == [50, 3]
    assert {int(i.task_id) for b in batches for i in b.items} == {t.id for t in sleepy}
    assert all(i.action == "REQUEUED" for b in batches for i in b.items)
    assert (await row(pool, other.id)).version == other.version
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await requeue(admin, filter=admin_pb2.TaskFilter(statuses=[task_pb2.TASK_STATUS_FAILED]))
    assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT


async def test_list_dead_letters_newest_first_in_pages(admin: Admin) -> None:
    pool = admin.backends.pool
    ids = []
    for n in range(3):
        task = await put_in(pool, Status.PROCESSING)
        out = await store.fail(
            pool,
            task.id,
            error=store.TaskError(f"E{n}", "bad"),
            reason="retries exhausted",
            actor="w1",
            dead_letter=True,
        )
        assert out.applied
        ids.append(task.id)

    first = await admin.stub.ListDeadLetters(admin_pb2.ListDeadLettersRequest(page_size=2), metadata=admin.admin)
    second = await admin.stub.ListDeadLetters(
        admin_pb2.ListDeadLettersRequest(page_size=2, page_token=first.next_page_token), metadata=admin.admin
    )

    got = [*first.dead_letters, *second.dead_letters]
    assert [int(d.task.id) for d in got] == ids[::-1] and not second.next_page_token
    assert [d.task.error_code for d in got] == ["E2", "E1", "E0"]
    assert all(d.reason == "retries exhausted" and d.task.status == task_pb2.TASK_STATUS_FAILED for d in got)


async def test_redeliver_callback_resets_the_deliveries(admin: Admin) -> None:
    pool = admin.backends.pool
    task = await insert_task(pool, callback_url="http://127.0.0.1:9/hook")
    event_id = await pool.fetchval("SELECT id FROM task_event WHERE task_id = $1", task.id)
    await pool.execute(
        "INSERT INTO callback_delivery (task_id, event_id, user_id, webhook_id, event_type, url, payload, status, "
        "attempts,  next_attempt_at, delivered_at) VALUES "
        "($1, $2, 'tenant-a', 'msg_a', 'task.created', 'http://127.0.0.1:9/a', '{}', 'DELIVERED', 1, now() - interval "
        "'1 day', now()), ($1, $2, 'tenant-a', 'msg_b', 'task.created', 'http://127.0.0.1:9/b', '{}', 'FAILED', 7, "
        "now() + interval '1 day', NULL)",
        task.id, event_id,
    )

    resp = await admin.stub.RedeliverCallback(
        admin_pb2.RedeliverCallbackRequest(task_id=str(task.id)), metadata=admin.admin
    )

    assert [(d.webhook_id, d.status, d.attempts) for d in resp.deliveries] == [
        ("msg_a", task_pb2.CALLBACK_STATUS_PENDING, 1), ("msg_b", task_pb2.CALLBACK_STATUS_PENDING, 7),
    ]
    rows = await pool.fetch("SELECT status, delivered_at, next_attempt_at <= now() AS due FROM callback_delivery")
    assert all(r["status"] == "PENDING" and r["delivered_at"] is None and r["due"] for r in rows)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await admin.stub.RedeliverCallback(admin_pb2.RedeliverCallbackRequest(task_id="4242"), metadata=admin.admin)
    assert err.value.code() is grpc.StatusCode.NOT_FOUND


async def test_repair_prints_the_plan_then_acts_in_batches(admin: Admin) -> None:
    pool = admin.backends.pool
    lost = [await put_in(pool, Status.PROCESSING, lease=0.000001) for _ in range(3)]
    created = await put_in(pool, Status.CREATED)
    await pool.execute("UPDATE task SET updated_at = now() - interval '31 seconds' WHERE id = $1", created.id)
    alive = await put_in(pool, Status.PROCESSING)
    before = await versions(admin)

    plan = io.StringIO()
    dry = await repair(admin.stub, True, 2, plan, metadata=admin.admin)
    assert dry.ok and dry.stuck == 4 and dry.batches == 2 and dry.outcomes == {"WOULD_REQUEUE": 4}
    assert await versions(admin) == before
    text = plan.getvalue()
    assert "stuck tasks: 4" in text and "dry run" in text and "LEASE_EXPIRED" in text and "CREATED_TOO_LONG" in text

    log = io.StringIO()
    done = await repair(admin.stub, False, 2, log, metadata=admin.admin)
    assert done.ok and done.batches == 2 and done.outcomes == {"REQUEUED": 4}
    assert "after batch 1:" in log.getvalue() and "after batch 2:" in log.getvalue()
    for t in [*lost, created]:
        assert (await row(pool, t.id)).status is Status.QUEUED
    assert (await row(pool, alive.id)).version == alive.version
    again = await repair(admin.stub, False, 2, io.StringIO(), metadata=admin.admin)
    assert again.ok and again.stuck == 0 and again.batches == 0


async def test_repair_stops_on_the_first_error(admin: Admin) -> None:
    pool = admin.backends.pool
    lost = [await put_in(pool, Status.PROCESSING, lease=0.000001) for _ in range(4)]
    await admin.backends.bus.js.delete_stream(busmod.TASKS_STREAM)  # every dispatch publish now fails
    before = await versions(admin)

    log = io.StringIO()
    result = await repair(admin.stub, False, 2, log, metadata=admin.admin)

    assert not result.ok and result.batches == 0 and "UNAVAILABLE" in (result.error or "")
    assert "error: stopped after 0 batch(es)" in log.getvalue()
    assert await versions(admin) == before
    assert [(await row(pool, t.id)).status for t in lost] == [Status.PROCESSING] * 4
    unauthenticated = await repair(admin.stub, True, 2, io.StringIO())
    assert unauthenticated.error is not None and unauthenticated.error.startswith("UNAUTHENTICATED")


async def test_requeue_of_a_row_a_scan_holds_is_skipped(admin: Admin) -> None:
    pool = admin.backends.pool
    task = await put_in(pool, Status.PROCESSING, lease=0.000001)
    async with pool.acquire() as conn, conn.transaction():
        await conn.execute("SELECT 1 FROM task WHERE id = $1 FOR UPDATE", task.id)  # what a scan in flight does
        [batch] = await requeue(admin, task_ids=[str(task.id)])
    [item] = batch.items
    assert item.action == "SKIPPED" and "busy" in item.detail
    assert (await row(pool, task.id)).version == task.version
    out = await store.release(pool, task.id, actor="test")
    assert out.applied  # nothing else changed it


# Replays: FAILED and TIMEOUT stay terminal; an operator's replay is a new task linked to its source.

REPLAYED_COLUMNS = (
    "user_id",
    "task_type",
    "model_id",
    "prompt",
    "request_payload",
    "request_hash",
    "priority",
    "metadata",
    "callback_url",
    "callback_events",
    "max_retries",
)




def actions(batches: list[admin_pb2.RequeueBatch]) -> dict[int, tuple[str, str]]:
    return {int(i.task_id): (i.action, i.detail) for b in batches for i in b.items}


async def task_count(pool: asyncpg.Pool) -> int:
    return int(await pool.fetchval("SELECT count(*) FROM task"))


async def test_a_dead_letter_and_a_timeout_are_replayed_as_linked_new_tasks_that_run(admin: Admin) -> None:
    pool, settings = admin.backends.pool, all_settings(admin.backends)
    image = {"sha256": "ab" * 32, "width": 32, "height": 32, "size_bytes": 1234}
    failed = await dead(pool, Status.FAILED, model_id="sleepy", priority=10, callback_url="http://127.0.0.1:9/hook")
    timed_out = await dead(pool, Status.TIMEOUT, params={
        "num_frames": 9, "width": 32, "height": 32, "num_inference_steps": 2, "guidance_scale": 5.0, "fps": 8,
        "seed": 77, "negative_prompt": "blur", "image": image,
    })
    await pool.execute(
        "UPDATE task SET metadata = '{\"team\": \"vfx\"}', callback_events = '{PROGRESS}' WHERE id = $1", failed.id
    )
    failed = await row(pool, failed.id)
    # the tenant is at its pending limit: a replay is an operator's act and is admitted all the same
    await pool.execute("UPDATE tenant SET max_pending = 1, submits_per_minute = 1 WHERE id = 'tenant-a'")
    await put_in(pool, Status.QUEUED)

    [batch] = await requeue(admin, task_ids=[str(failed.id), str(timed_out.id)], replay_finished=True)

    done = actions([batch])
    replays: dict[int, TaskRow] = {}
    for source in (failed, timed_out):
        action, detail = done[source.id]
        assert action == "REPLAYED" and detail.startswith("as task "), detail
        replays[source.id] = await row(pool, int(detail.removeprefix("as task ")))
    for source in (failed, timed_out):
        again = replays[source.id]
        assert again.id != source.id and again.replay_of == source.id
        assert [getattr(again, c) for c in REPLAYED_COLUMNS] == [getattr(source, c) for c in REPLAYED_COLUMNS]
        assert again.idempotency_key.startswith(f"replay-{source.id}-") and not again.idempotency_derived
        assert again.to_proto().replay_of == str(source.id)
        after = await row(pool, source.id)  # the source stays as it ended
        assert (after.status, after.version) == (source.status, source.version)
        letter = await pool.fetchrow("SELECT replayed_as, replayed_at FROM dead_letter WHERE task_id = $1", source.id)
        assert letter["replayed_as"] == again.id and letter["replayed_at"] is not None
    assert (
        replays[timed_out.id].request_payload["seed"] == 77 and replays[timed_out.id].request_payload["image"] == image
    )
    assert replays[failed.id].priority == 10 and replays[failed.id].callback_events == ["PROGRESS"]
    # dispatched at once, under the dispatcher's own message ids
    assert {t.status for t in [await row(pool, r.id) for r in replays.values()]} == {Status.QUEUED}
    assert {msg_id for _, msg_id, _ in await dispatches(admin.backends.bus)} >= {f"{r.id}.q0" for r in replays.values()}
    letters = await admin.stub.ListDeadLetters(admin_pb2.ListDeadLettersRequest(), metadata=admin.admin)
    linked = {int(d.task.id): (d.replayed_as, d.HasField("replayed_at")) for d in letters.dead_letters}
    assert linked == {s.id: (str(replays[s.id].id), True) for s in (failed, timed_out)}

    worker = await worker_service.start(sleepy_settings(settings))  # the FAILED one was on the 'sleep' model
    try:
        await wait_for(lambda: _status_is(pool, replays[failed.id].id, Status.SUCCEEDED), within=20)
    finally:
        await worker.stop(grace=0)


async def _status_is(pool: asyncpg.Pool, task_id: int, status: Status) -> bool:
    return bool(await pool.fetchval("SELECT status::text = $2 FROM task WHERE id = $1", task_id, status.value))


async def test_without_the_flag_finished_tasks_are_skipped_with_why_and_a_dry_run_creates_nothing(admin: Admin) -> None:
    pool = admin.backends.pool
    failed, timed_out = await dead(pool, Status.FAILED), await dead(pool, Status.TIMEOUT)
    succeeded, canceled = await put_in(pool, Status.SUCCEEDED), await put_in(pool, Status.CANCELED)
    queued = await put_in(pool, Status.QUEUED)
    named = [str(t.id) for t in (failed, timed_out, succeeded, canceled)]
    tasks, before = await task_count(pool), await versions(admin)

    plain = actions(await requeue(admin, task_ids=[*named, str(queued.id)]))

    for task in (failed, timed_out):
        action, detail = plain[task.id]
        assert (
            action == "SKIPPED"
            and "terminal" in detail
            and "replay_finished" in detail
            and "--replay-finished" in detail
        )
    for task in (succeeded, canceled):
        action, detail = plain[task.id]
        assert action == "SKIPPED" and "never replayed" in detail, detail
    assert plain[queued.id][0] == "REQUEUED"
    assert await task_count(pool) == tasks

    dry = await requeue(admin, task_ids=named, replay_finished=True, dry_run=True)

    assert [b.dry_run for b in dry] == [True]
    assert {i: a for i, (a, _) in actions(dry).items()} == {
        failed.id: "WOULD_REPLAY", timed_out.id: "WOULD_REPLAY", succeeded.id: "SKIPPED", canceled.id: "SKIPPED",
    }
    assert await task_count(pool) == tasks
    assert {k: v for k, v in (await versions(admin)).items() if k != queued.id} == {
        k: v for k, v in before.items() if k != queued.id
    }
    assert await pool.fetchval("SELECT count(*) FROM dead_letter WHERE replayed_as IS NOT NULL") == 0
    with pytest.raises(grpc.aio.AioRpcError) as err:  # a filter naming a state that is never replayed
        await requeue(
            admin, filter=admin_pb2.TaskFilter(statuses=[task_pb2.TASK_STATUS_SUCCEEDED]), replay_finished=True
        )
    assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT and "never" in (err.value.details() or "")


async def test_a_task_is_replayed_once_and_a_replay_that_failed_is_replayed_itself(admin: Admin) -> None:
    pool = admin.backends.pool
    first, other = await dead(pool, Status.FAILED), await dead(pool, Status.FAILED)
    [(action, detail)] = actions(await requeue(admin, task_ids=[str(first.id)], replay_finished=True)).values()
    replay = int(detail.removeprefix("as task "))
    assert action == "REPLAYED"

    again = actions(await requeue(admin, task_ids=[str(first.id)], replay_finished=True))

    assert again == {
        first.id: ("SKIPPED", f"FAILED and already replayed as task {replay}; replay that task if it failed too")
    }
    # a filter leaves out what was replayed: sent twice, it replays each task once
    by_filter = admin_pb2.TaskFilter(statuses=[task_pb2.TASK_STATUS_FAILED])
    [(other_id, (other_action, _))] = actions(await requeue(admin, filter=by_filter, replay_finished=True)).items()
    assert (other_id, other_action) == (other.id, "REPLAYED")
    assert await requeue(admin, filter=by_filter, replay_finished=True) == []
    # the replay failed too: it is replayed in turn, and the chain is linked
    await claimed(pool, replay, lease_seconds=10.0)
    assert (
        await store.fail(pool, replay, error=store.TaskError("E", "again"), actor="w1", reason="x", dead_letter=True)
    ).applied
    [(action, detail)] = actions(await requeue(admin, task_ids=[str(replay)], replay_finished=True)).values()
    third = await row(pool, int(detail.removeprefix("as task ")))
    assert action == "REPLAYED" and third.replay_of == replay and (await row(pool, replay)).replay_of == first.id
    with pytest.raises(asyncpg.UniqueViolationError):  # the schema holds one replay per task, whatever the caller
        await insert_replay(pool, first)


async def insert_replay(pool: asyncpg.Pool, source: TaskRow) -> None:
    await admin_store.replay_tasks(pool, [(replay_of(source, ids.new_id()), source.id)])


async def test_a_replay_whose_dispatch_fails_stays_created_for_the_scan_and_needs_no_dead_letter(admin: Admin) -> None:
    pool = admin.backends.pool
    source = await put_in(pool, Status.FAILED)  # failed for good without a dead letter (a final error)
    await admin.backends.bus.js.delete_stream(busmod.TASKS_STREAM)  # every dispatch publish now fails

    [(action, detail)] = actions(await requeue(admin, task_ids=[str(source.id)], replay_finished=True)).values()

    assert action == "REPLAYED" and "did not queue it" in detail, detail
    replay = await row(pool, int(detail.split()[2]))
    assert (replay.status, replay.replay_of) == (Status.CREATED, source.id)  # committed: the CreatedScan's to dispatch
    assert await pool.fetchval("SELECT count(*) FROM dead_letter") == 0
