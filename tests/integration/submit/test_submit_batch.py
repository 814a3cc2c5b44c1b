"""Submissions a batch at a time: one statement admits a batch exactly as one-by-one admission would, duplicates
inside a batch included; limits hold under a concurrent burst on two replicas; the batcher runs what queued; each
tenant's pending count is kept by the moves themselves."""

from __future__ import annotations

import asyncio
from typing import Any

import grpc

from services.submit.service import start
from taskgate import auth, ids, store
from taskgate import bus as busmod
from taskgate.config import Settings
from taskgate.migrate import migrate
from taskgate.runtime import Backends
from taskgate.states import Status
from taskgate.store import submissions
from taskgate.store.submissions import Admission, AdmitVerdict, Candidate, NewTask
from taskgate_api.v1 import gateway_pb2, gateway_pb2_grpc
from tests.support.factories import claimed, insert_task, key_for
from tests.support.harness import info_of, outcome, wait_for


def new_task(tenant: str, key: str, request: str = "r") -> NewTask:
    return NewTask(
        id=ids.new_id(), user_id=tenant, idempotency_key=key, key_derived=False, request_hash=request,
        task_type="text-to-video", model_id="wan-tiny", prompt=request, payload={"seed": 1}, metadata={}, priority=5,
        max_retries=3, callback_url=None, callback_events=[],
    )


def summary(admission: Admission) -> tuple[AdmitVerdict, str | None]:
    return admission.verdict, admission.task.idempotency_key if admission.task else None


# (tenant suffix, idempotency key, request, per minute or None when the slot is already taken)
BATCH = [
    ("a", "k1", "one", 3), ("a", "k1", "one", 3), ("a", "k1", "other", 3),  # copies of a key: no slot of their own
    ("a", "k2", "two", 3), ("a", "k3", "three", 3),                         # k3: over a's pending limit (2)
    # a replay takes no slot; a's window (3) is full
    ("a", "k2", "two", 3), ("a", "k4", "four", 3),
    ("a", "k5", "five", None),                                             # its slot was taken beforehand
    ("b", "k1", "one", 9), ("b", "old", "kept", 9),                        # b: another tenant, an existing key
    ("gone", "k1", "one", 9),                                              # no such tenant
]


async def test_a_batch_is_admitted_as_one_by_one_would_be(backends: Backends) -> None:
    pool, pepper = backends.pool, backends.settings.api_key_pepper
    for run in ("batch", "single"):
        await auth.create_key(pool, pepper, f"{run}-a", max_pending=2)
        await auth.create_key(pool, pepper, f"{run}-b", max_pending=5)
        old = await submissions.admit(
            pool, [Candidate(new_task(f"{run}-b", "old", "kept"), None)], default_max_pending=5
        )
        assert old[0].verdict is AdmitVerdict.CREATED

    def candidates(run: str) -> list[Candidate]:
        return [Candidate(new_task(f"{run}-{t}", key, request), per_minute) for t, key, request, per_minute in BATCH]

    batch = await submissions.admit(pool, candidates("batch"), default_max_pending=5)
    single = [(await submissions.admit(pool, [c], default_max_pending=5))[0] for c in candidates("single")]
    assert [summary(a) for a in batch] == [summary(a) for a in single]
    assert [a.verdict for a in batch] == [
        AdmitVerdict.CREATED,
        AdmitVerdict.EXISTING,
        AdmitVerdict.EXISTING,
        AdmitVerdict.CREATED,
        AdmitVerdict.TOO_MANY_PENDING,
        AdmitVerdict.EXISTING,
        AdmitVerdict.RATE_LIMITED,
        AdmitVerdict.TOO_MANY_PENDING,
        AdmitVerdict.CREATED,
        AdmitVerdict.EXISTING,
        AdmitVerdict.NO_TENANT,
    ]
    # copies of a key answer with the first copy's task (the service compares the requests: ALREADY_EXISTS)
    assert batch[0].task is not None and batch[1].task == batch[0].task == batch[2].task
    assert batch[2].task.request_hash == "one"
    assert batch[6].retry_after is not None and 0 < batch[6].retry_after <= 60
    assert batch[4].pending_limit == 2
    for run in ("batch", "single"):
        rows = await pool.fetch("SELECT idempotency_key FROM task WHERE user_id = $1 ORDER BY 1", f"{run}-a")
        assert [r[0] for r in rows] == ["k1", "k2"]
        assert await pool.fetchval("SELECT count FROM rate_window WHERE tenant_id = $1", f"{run}-a") == 3  # k1, k2, k3
    # history: version 1 of each new task, nothing for the others
    events = await pool.fetch(
        "SELECT e.task_id FROM task_event e JOIN task t ON t.id = e.task_id WHERE t.user_id LIKE 'batch-%' "
        "AND t.idempotency_key <> 'old'")
    assert len(events) == 3


async def _eq(value: Any, expected: object) -> bool:
    return bool(await value == expected)


async def test_concurrent_burst_keeps_every_limit_on_two_replicas(settings: Settings, backends: Backends) -> None:
    pending_md = await key_for(backends, "pending", max_pending=7, submits_per_minute=1000)
    rate_md = await key_for(backends, "rate", max_pending=100, submits_per_minute=5)
    replicas = [await start(settings), await start(settings)]
    channels = [grpc.aio.insecure_channel(f"127.0.0.1:{r.port}") for r in replicas]
    try:
        stubs = [gateway_pb2_grpc.TaskGatewayStub(c) for c in channels]

        def call(i: int, md: Any, **fields: Any) -> Any:
            request = gateway_pb2.SubmitTaskRequest(prompt=f"job {i}", **fields)
            return outcome(stubs[i % 2].SubmitTask(request, metadata=md, timeout=10))

        burst = [call(i, pending_md) for i in range(30)] + [call(i, rate_md) for i in range(30)]
        # the same key for two different requests, and the same request three times, all in flight together
        burst += [call(1, pending_md, idempotency_key="dup"), call(2, pending_md, idempotency_key="dup")]
        burst += [call(3, rate_md, idempotency_key="same") for _ in range(3)]
        results = await asyncio.gather(*burst)
        await wait_for(lambda: _eq(backends.pool.fetchval("SELECT count(*) FROM task WHERE status = 'CREATED'"), 0))
    finally:
        for channel in channels:
            await channel.close()
        for replica in replicas:
            await replica.stop(0)

    def codes(part: list[tuple[grpc.StatusCode, list[Any], Any]]) -> list[grpc.StatusCode]:
        return [code for code, _, _ in part]

    pending, rate = results[:30], results[30:60]
    dup, same = results[60:62], results[62:]
    pending_ok = codes(pending).count(grpc.StatusCode.OK) + codes(dup).count(grpc.StatusCode.OK)
    assert pending_ok == 7 and codes(dup).count(grpc.StatusCode.OK) <= 1
    assert all(info_of(d).reason == "TOO_MANY_PENDING_TASKS" for c, d, _ in pending + dup
               if c == grpc.StatusCode.RESOURCE_EXHAUSTED)
    assert await backends.pool.fetchval("SELECT count(*) FROM task WHERE user_id = 'pending'") == 7
    # a minute window of 5: five tasks counted, whichever replica took them; the copies of "same" share one task, and
    # a copy that arrives once it exists is a replay, answered with it without a slot
    rate_ok = [r for c, _, r in rate + same if c == grpc.StatusCode.OK]
    assert all(info_of(d).reason == "RATE_LIMITED" for c, d, _ in rate + same if c != grpc.StatusCode.OK)
    assert len({r.task.id for r in rate_ok}) == 5 and len(rate_ok) <= 5 + 2
    assert await backends.pool.fetchval("SELECT sum(count) FROM rate_window WHERE tenant_id = 'rate'") == 5
    assert await backends.pool.fetchval("SELECT count(*) FROM task WHERE user_id = 'rate'") == len(
        {r.task.id for r in rate_ok})
    # every created task has its one dispatch message
    created = await backends.pool.fetchval("SELECT count(*) FROM task")
    assert (await backends.bus.js.stream_info(busmod.TASKS_STREAM)).state.messages == created


async def test_duplicates_inside_one_batch_make_one_task_and_already_exists(
    settings: Settings, backends: Backends
) -> None:
    md = await key_for(backends, max_pending=10)
    handle = await start(settings, backends)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{handle.port}") as channel:
            stub = gateway_pb2_grpc.TaskGatewayStub(channel)
            same = gateway_pb2.SubmitTaskRequest(prompt="same", idempotency_key="k")
            other = gateway_pb2.SubmitTaskRequest(prompt="other", idempotency_key="k")
            results = await asyncio.gather(
                *(outcome(stub.SubmitTask(same, metadata=md, timeout=10)) for _ in range(5)),
                *(outcome(stub.SubmitTask(other, metadata=md, timeout=10)) for _ in range(2)),
            )
    finally:
        await handle.stop(0)
    oks = [r for c, _, r in results if c == grpc.StatusCode.OK]
    refused = [c for c, _, _ in results if c != grpc.StatusCode.OK]
    assert await backends.pool.fetchval("SELECT count(*) FROM task") == 1
    assert len({r.task.id for r in oks}) == 1 and sum(r.created for r in oks) == 1
    assert set(refused) <= {grpc.StatusCode.ALREADY_EXISTS} and len(oks) + len(refused) == 7
    winner = await backends.pool.fetchval("SELECT prompt FROM task")
    assert len(oks) == (5 if winner == "same" else 2)










async def test_pending_counts_follow_every_move(backends: Backends) -> None:
    pool = backends.pool
    real = ("SELECT user_id, count(*) FROM task WHERE status IN ('CREATED', 'QUEUED', 'PROCESSING') GROUP BY user_id")

    async def counts_match() -> dict[str, int]:
        kept = {
            r[0]: r[1] for r in await pool.fetch("SELECT tenant_id, pending FROM tenant_pending WHERE pending <> 0")
        }
        assert kept == {r[0]: r[1] for r in await pool.fetch(real)}
        return kept

    tasks = {t: [await insert_task(pool, user_id=t) for _ in range(6)] for t in ("ta", "tb")}
    assert await counts_match() == {"ta": 6, "tb": 6}
    a, b = tasks["ta"], tasks["tb"]
    await submissions.queue_created(pool, a[:4] + b[:2], actor="test")
    for task in (a[0], b[0], a[1], b[1], a[2]):  # the order the fair claim takes them in (by tenant, then oldest)
        await claimed(pool, task.id, worker_id="w")
    await store.succeed(pool, a[0].id, attempt=1, result=store.ResultRef("u", "video/mp4", 1, "s"), actor="test")
    await store.fail(
        pool, a[1].id, attempt=1, error=store.TaskError("E", "m"), actor="test", reason="r", dead_letter=True
    )
    await store.retry(pool, a[2].id, attempt=1, error=store.TaskError("E", "m"), delay_seconds=0, actor="test")
    await store.release(pool, b[0].id, actor="test", reason="lost")
    await store.cancel(pool, a[3].id, mode=store.CancelMode.SOFT, actor="test")
    await store.cancel(pool, b[5].id, mode=store.CancelMode.HARD, actor="test")
    await store.time_out(pool, b[1].id, error=store.TaskError("T", "m"), actor="test", reason="r")
    await claimed(pool, b[0].id, worker_id="w")
    await store.progress(pool, b[0].id, attempt=2, percent=50, lease_seconds=30, actor="test")
    assert await counts_match() == {"ta": 3, "tb": 4}
    # a statement moving many tasks of several tenants, and deletions (retention) of finished and unfinished ones
    await pool.execute("UPDATE task SET status = 'CANCELED', version = version + 1, finished_at = now() "
                       "WHERE status IN ('CREATED', 'QUEUED') AND id <> $1", a[4].id)
    await pool.execute("DELETE FROM task WHERE id = ANY($1::bigint[])", [a[0].id, a[4].id, b[0].id])
    assert await counts_match() == {}
    # the counts are recounted whenever the triggers are installed: a drifted count is mended by a migrate
    await pool.execute("UPDATE tenant_pending SET pending = 41")
    await insert_task(pool, user_id="ta")
    async with pool.acquire() as conn:
        await migrate(conn)
    assert await counts_match() == {"ta": 1}




async def test_the_queue_move_takes_only_created_tasks_and_commits_asynchronously(backends: Backends) -> None:
    """One statement moves the CREATED ones of a pass's tasks, each with its history row, and leaves the rest; its
    commit is asynchronous (synchronous_commit off until that transaction ends), and nothing after it is."""
    pool = backends.pool
    tasks = [await insert_task(pool) for _ in range(3)]
    await store.cancel(pool, tasks[2].id, mode=store.CancelMode.HARD, actor="test")
    async with pool.acquire() as conn, conn.transaction():
        assert await conn.fetchval("SHOW synchronous_commit") == "on"
        moved = await submissions.queue_created(conn, tasks, actor="dispatcher", reason="published")
        assert await conn.fetchval("SHOW synchronous_commit") == "off"  # until this transaction commits
    assert [(t.id, t.status, t.version, t.last_actor) for t in moved] == [
        (t.id, Status.QUEUED, 2, "dispatcher") for t in tasks[:2]]
    assert await pool.fetchval("SHOW synchronous_commit") == "on"
    rows = await pool.fetch("SELECT id, status, version, queued_at IS NOT NULL AS queued FROM task ORDER BY id")
    assert [tuple(r) for r in rows] == [(tasks[0].id, "QUEUED", 2, True), (tasks[1].id, "QUEUED", 2, True),
                                        (tasks[2].id, "CANCELED", 2, False)]
    events = await pool.fetch("SELECT task_id, version, from_status, to_status, actor, reason FROM task_event "
                              "WHERE to_status = 'QUEUED' ORDER BY task_id")
    assert [tuple(r) for r in events] == [(t.id, 2, "CREATED", "QUEUED", "dispatcher", "published") for t in tasks[:2]]
    assert await submissions.queue_created(pool, tasks, actor="dispatcher") == []  # none is CREATED any more


async def test_each_task_a_batch_creates_gets_one_creation_event(backends: Backends) -> None:
    """The history trigger runs once for the batch's insert (a statement-level trigger): still one version-1 event and
    one outbox row per created task, none for a replay or a refusal, and each tenant's pending count grown by the
    tasks created."""
    pool = backends.pool
    await auth.create_key(pool, backends.settings.api_key_pepper, "bulk-a", max_pending=60)
    await auth.create_key(pool, backends.settings.api_key_pepper, "bulk-b", max_pending=60)
    [first] = await submissions.admit(pool, [Candidate(new_task("bulk-a", "k1"), 1000)], default_max_pending=60)
    assert first.verdict is AdmitVerdict.CREATED and first.task is not None
    # 66 items of bulk-a (k1 a replay; 59 places left of 60) and 34 of bulk-b, interleaved
    batch = [Candidate(new_task("bulk-b" if i % 3 == 0 else "bulk-a", f"k{i}"), 1000) for i in range(100)]
    answers = await submissions.admit(pool, batch, default_max_pending=60)
    verdicts = [a.verdict for a in answers]
    assert verdicts[1] is AdmitVerdict.EXISTING and answers[1].task is not None and answers[1].task.id == first.task.id
    assert (verdicts.count(AdmitVerdict.CREATED), verdicts.count(AdmitVerdict.TOO_MANY_PENDING)) == (59 + 34, 6)
    created = [a.task.id for a in answers if a.verdict is AdmitVerdict.CREATED and a.task is not None]
    events = await pool.fetch(
        "SELECT e.task_id, e.version, e.from_status, e.to_status::text, e.actor, o.event_id IS NOT NULL AS outboxed "
        "FROM task_event e LEFT JOIN event_outbox o ON o.event_id = e.id ORDER BY e.task_id"
    )
    assert [r["task_id"] for r in events] == sorted([first.task.id, *created])  # one each, for every task created
    assert {(r["version"], r["from_status"], r["to_status"], r["actor"], r["outboxed"]) for r in events} == {
        (1, None, "CREATED", "submit", True)}
    pending = {r[0]: r[1] for r in await pool.fetch("SELECT tenant_id, pending FROM tenant_pending")}
    assert pending == {"bulk-a": 60, "bulk-b": 34}
