"""The worker against real PostgreSQL and NATS JetStream, with the 'sleep' stand-in model."""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import json
import os
import re
import signal
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path

import grpc
import pytest
from google.protobuf.duration_pb2 import Duration

from services.scheduler import service as scheduler_service
from services.worker.retry import backoff
from taskgate import auth, results, store
from taskgate import bus as busmod
from taskgate.config import Settings
from taskgate.runtime import Backends
from taskgate.states import Priority, Status
from taskgate.store import CancelMode, Rejection, ResultRef, TaskError
from taskgate.store import workers as registry
from taskgate.wire import cancel
from taskgate_api.v1 import worker_pb2, worker_pb2_grpc
from tests.support.factories import (
    SLEEPY,
    all_settings,
    claimed,
    insert_task,
    key_for,
    params,
    publish,
    sleepy_settings,
    submit,
    with_,
)
from tests.support.harness import ROOT, stored_objects, wait_for
from tests.support.harness import WorkerFactory as Factory
from tests.support.queries import events, is_status, read_result, report_for, wait_consumer_empty, wait_task


@dataclass(frozen=True)
class Operator:
    """A running TaskAdmin (which vouches for WorkerControl callers) and an admin key's call metadata."""

    target: str
    metadata: tuple[tuple[str, str], ...]


@pytest.fixture
async def operator(backends: Backends) -> AsyncIterator[Operator]:
    handle = await scheduler_service.start(all_settings(backends), backends, scan_loop=False)
    key, _ = await auth.create_key(backends.pool, backends.settings.api_key_pepper, "ops", admin=True)
    try:
        yield Operator(f"127.0.0.1:{handle.port}", (("authorization", f"Bearer {key}"),))
    finally:
        await handle.stop(0)






















# ---- pure logic ----








def test_backoff_doubles_with_jitter_and_is_capped(settings: Settings) -> None:
    s = with_(settings, retry_backoff_seconds=1.0, retry_jitter=0.2, retry_backoff_max_seconds=5.0)
    delays = [backoff(s, n) for n in range(4)]
    assert 0.8 <= delays[0] <= 1.2 and 1.6 <= delays[1] <= 2.4 and 3.2 <= delays[2] <= 4.8
    assert delays[3] == 5.0
    assert delays[0] < delays[1] < delays[2]


# ---- end to end with the sleep model ----


async def test_task_runs_end_to_end_with_progress_and_status(
    settings: Settings, backends: Backends, workers: Factory, operator: Operator
) -> None:
    s = with_(sleepy_settings(settings, sleep=0.6), worker_admin_target=operator.target)
    handle = await workers(s)
    task = await submit(backends, params=params(steps=6))
    await wait_task(backends, task.id, is_status(Status.PROCESSING))

    async with grpc.aio.insecure_channel(f"127.0.0.1:{handle.port}") as channel:
        status = await worker_pb2_grpc.WorkerControlStub(channel).GetStatus(
            worker_pb2.GetStatusRequest(), metadata=operator.metadata
        )
    assert (status.worker_id, status.device, list(status.models)) == (handle.worker_id, "cpu", [SLEEPY])
    assert (status.slots, status.free_slots, status.draining) == (1, 0, False)
    assert [(r.task_id, r.attempt) for r in status.running] == [(str(task.id), 1)]

    row = await wait_task(backends, task.id, is_status(Status.SUCCEEDED))
    assert (row.attempt, row.worker_id, row.progress, row.result_reused) == (1, handle.worker_id, 100, False)
    # a small output is kept in the row by the terminal commit itself (result_inline_max_bytes): no store, no object
    assert row.result_uri is not None and row.result_uri.startswith("data:application/json;base64,")
    assert await stored_objects(backends.bus, f"{task.id}-") == []
    data = await read_result(s, backends, row.result_uri)
    assert len(data) == row.result_size and json.loads(data)["steps"] == 6
    assert hashlib.sha256(data).hexdigest() == row.result_sha256
    history = await events(backends, task.id)
    progress = [e["progress"] for e in history if e["to_status"] == "PROCESSING"]
    assert progress == sorted(progress) and len(set(progress)) >= 3  # claim at 0, then rising steps
    assert [e["actor"] for e in history][-1] == "worker"
    await wait_consumer_empty(backends, SLEEPY, Priority.NORMAL)
    registered = await backends.pool.fetchrow("SELECT * FROM worker WHERE id = $1", handle.worker_id)
    assert registered is not None and registered["models"] == [SLEEPY] and registered["slots"] == 1


async def test_claim_of_a_created_task_wins_over_a_slow_submit(
    settings: Settings, backends: Backends, workers: Factory
) -> None:
    await workers(sleepy_settings(settings))
    task = await submit(backends, queue=False)  # the message outruns the CREATED -> QUEUED commit
    row = await wait_task(backends, task.id, is_status(Status.SUCCEEDED))
    assert row.queued_at is None and row.attempt == 1
    late = await store.queue(backends.pool, task.id, actor="submit")
    assert late.rejection is Rejection.ILLEGAL and late.task is not None and late.task.status is Status.SUCCEEDED


async def test_message_for_a_canceled_task_is_acked_and_dropped(
    settings: Settings, backends: Backends, workers: Factory
) -> None:
    handle = await workers(sleepy_settings(settings))
    task = await insert_task(backends.pool, model_id=SLEEPY)
    canceled = await store.cancel(backends.pool, task.id, mode=CancelMode.SOFT, actor="submit")
    assert canceled.applied
    await publish(backends, task, f"{task.id}.q0")
    await handle.worker.signals.reported.wait_for(report_for(task.id, "refused"))
    await wait_consumer_empty(backends, SLEEPY, Priority.NORMAL)
    row = await store.get_task(backends.pool, task.id)
    assert row is not None and row.status is Status.CANCELED and row.attempt == 0


async def test_redelivery_while_the_lease_is_live_is_acked_and_dropped(
    settings: Settings, backends: Backends, workers: Factory
) -> None:
    handle = await workers(sleepy_settings(settings, sleep=0.8), worker_slots=2)
    task = await submit(backends, params=params(steps=2))
    await wait_task(backends, task.id, is_status(Status.PROCESSING))
    await publish(backends, task, f"{task.id}.p1")  # a re-publish of a task that is running
    refused = await handle.worker.signals.reported.wait_for(report_for(task.id, "refused"))
    assert refused.attempt == 0
    row = await wait_task(backends, task.id, is_status(Status.SUCCEEDED))
    assert row.attempt == 1
    await wait_consumer_empty(backends, SLEEPY, Priority.NORMAL)
    claims = [e for e in await events(backends, task.id) if e["to_status"] == "PROCESSING" and e["progress"] == 0]
    assert len(claims) == 1


async def test_retryable_failure_is_retried_with_growing_delays_then_dead_lettered(
    settings: Settings, backends: Backends, workers: Factory
) -> None:
    s = with_(
        sleepy_settings(settings, fail_times=99, fail_code="TRANSIENT_IO"), retry_backoff_seconds=0.15, retry_jitter=0.1
    )
    handle = await workers(s)
    dead = await backends.bus.js.subscribe(busmod.dead_subject(SLEEPY))
    task = await submit(backends, params=params(steps=1), max_retries=2)
    row = await wait_task(backends, task.id, is_status(Status.FAILED))
    assert (row.attempt, row.retry_count, row.error_code) == (3, 2, "TRANSIENT_IO")

    retried = [r for r in handle.worker.signals.reported.seen if r.task_id == task.id and r.outcome == "retried"]
    assert [r.attempt for r in retried] == [1, 2]
    assert retried[0].delay is not None and retried[1].delay is not None and retried[0].delay < retried[1].delay
    history = await events(backends, task.id)
    # the first claim may come from CREATED: this helper publishes before it queues (DESIGN-NOTES race 1)
    claims = [e["at"] for e in history if e["to_status"] == "PROCESSING" and e["from_status"] in ("CREATED", "QUEUED")]
    retries = [e["at"] for e in history if e["to_status"] == "QUEUED" and e["from_status"] == "PROCESSING"]
    gaps = [(c - r).total_seconds() for r, c in zip(retries, claims[1:], strict=True)]
    assert gaps[0] >= 0.15 * 0.9 - 0.01 and gaps[1] >= 0.3 * 0.9 - 0.01 and gaps[1] > gaps[0]

    letter = await backends.pool.fetchrow("SELECT * FROM dead_letter WHERE task_id = $1", task.id)
    assert letter is not None and letter["reason"] == "retries exhausted" and letter["error_code"] == "TRANSIENT_IO"
    msg = await dead.next_msg(timeout=5)
    body = json.loads(msg.data)
    assert (body["task_id"], body["error_code"], body["retry_count"]) == (str(task.id), "TRANSIENT_IO", 2)
    await wait_consumer_empty(backends, SLEEPY, Priority.NORMAL)


async def test_permanent_failure_fails_at_once(settings: Settings, backends: Backends, workers: Factory) -> None:
    s = sleepy_settings(settings, fail_times=99, fail_code="INVALID_PARAMETERS", fail_retryable=False)
    await workers(s)
    task = await submit(backends, params=params(steps=1), max_retries=3)
    row = await wait_task(backends, task.id, is_status(Status.FAILED))
    assert (row.attempt, row.retry_count, row.error_code) == (1, 0, "INVALID_PARAMETERS")
    assert row.error_msg is not None and "injected failure" in row.error_msg
    assert await backends.pool.fetchval("SELECT count(*) FROM dead_letter WHERE task_id = $1", task.id) == 0
    await wait_consumer_empty(backends, SLEEPY, Priority.NORMAL)


async def test_soft_cancel_keeps_the_output_and_an_identical_task_reuses_it(
    settings: Settings, backends: Backends, workers: Factory
) -> None:
    handle = await workers(sleepy_settings(settings, sleep=0.6))
    first = await submit(backends, params=params(steps=3))
    await wait_task(backends, first.id, is_status(Status.PROCESSING))
    assert (await store.cancel(backends.pool, first.id, mode=CancelMode.SOFT, actor="submit")).applied
    assert await cancel.send(backends.bus, first.id, hard=False, reason="test")
    kept = await handle.worker.signals.reported.wait_for(report_for(first.id), within=5)
    assert kept.outcome == "soft_canceled" and kept.steps_done == 3
    row = await store.get_task(backends.pool, first.id)
    assert row is not None and row.status is Status.CANCELED and row.result_uri is None
    reusable = await backends.pool.fetchrow("SELECT * FROM reusable_result WHERE source_task_id = $1", first.id)
    assert reusable is not None and reusable["request_hash"] == first.request_hash
    stored = await read_result(handle.worker.settings, backends, reusable["result_uri"])
    assert len(stored) == reusable["result_size"]

    second = await submit(backends, params=params(steps=3))
    assert second.request_hash == first.request_hash
    done = await wait_task(backends, second.id, is_status(Status.SUCCEEDED))
    assert done.result_reused and (done.result_uri, done.result_sha256) == (
        reusable["result_uri"],
        reusable["result_sha256"],
    )
    reused = await handle.worker.signals.reported.wait_for(report_for(second.id))
    assert reused.outcome == "reused" and reused.steps_done == 0
    await wait_consumer_empty(backends, SLEEPY, Priority.NORMAL)


async def test_hard_cancel_of_a_sleep_run_frees_the_slot_at_once(
    settings: Settings, backends: Backends, workers: Factory
) -> None:
    handle = await workers(sleepy_settings(settings, sleep=20.0))
    task = await submit(backends, params=params(steps=100))
    await wait_task(backends, task.id, lambda r: r.status is Status.PROCESSING and r.progress > 0)
    assert (await store.cancel(backends.pool, task.id, mode=CancelMode.HARD, actor="submit")).applied
    started = time.monotonic()
    assert await cancel.send(backends.bus, task.id, hard=True, reason="test")
    report = await handle.worker.signals.reported.wait_for(report_for(task.id), within=5)
    assert time.monotonic() - started < 5.0  # one 0.2 s step (plus a loaded machine's delays), not the 20 s run
    assert report.outcome == "canceled" and report.steps_at_abort is not None
    assert report.steps_done <= report.steps_at_abort + 1 < 100
    assert handle.worker.status().free_slots == 1
    await wait_consumer_empty(backends, SLEEPY, Priority.NORMAL)


async def test_a_task_timed_out_elsewhere_is_stopped_at_the_next_lease_renewal(
    settings: Settings, backends: Backends, workers: Factory
) -> None:
    handle = await workers(sleepy_settings(settings, sleep=20.0))
    task = await submit(backends, params=params(steps=100))
    await wait_task(backends, task.id, lambda r: r.status is Status.PROCESSING and r.progress > 0)
    # What the scheduler does on a processing timeout, here without the cancel signal: the renewal must notice.
    timed_out = await store.time_out(
        backends.pool,
        task.id,
        error=TaskError("PROCESSING_TIMEOUT", "took too long"),
        actor="scheduler",
        reason="processing timeout",
    )
    assert timed_out.applied
    started = time.monotonic()
    report = await handle.worker.signals.reported.wait_for(report_for(task.id), within=5)
    assert report.outcome == "terminal" and time.monotonic() - started < 10.0  # a renewal or two, not the 20 s run
    assert handle.worker.status().free_slots == 1
    row = await store.get_task(backends.pool, task.id)
    assert row is not None and row.status is Status.TIMEOUT and row.result_uri is None
    await wait_consumer_empty(backends, SLEEPY, Priority.NORMAL)


async def test_crashed_workers_task_is_finished_by_another_exactly_once(
    settings: Settings, backends: Backends, workers: Factory
) -> None:
    # stored outputs (not inline): the output's name says which attempt wrote it
    s = with_(sleepy_settings(settings, sleep=1.0), lease_seconds=2.0, heartbeat_seconds=0.5, result_inline_max_bytes=0)
    first = await workers(s)
    task = await submit(backends, params=params(steps=4))
    await wait_task(backends, task.id, lambda r: r.status is Status.PROCESSING and r.progress > 0)
    await first.kill()
    second = await workers(s)
    running = await wait_task(backends, task.id, lambda r: r.attempt == 2, within=20)
    assert running.worker_id == second.worker_id
    stale = await store.progress(
        backends.pool, task.id, attempt=1, percent=90, lease_seconds=1.0, actor="worker"
    )  # the crashed attempt's write
    assert stale.rejection in (Rejection.STALE, Rejection.ILLEGAL) and not stale.applied
    row = await wait_task(backends, task.id, is_status(Status.SUCCEEDED))
    assert (row.attempt, row.worker_id) == (2, second.worker_id) and row.result_uri is not None
    assert re.search(r"-a2-[0-9a-f]{12}\.json$", row.result_uri)
    history = await events(backends, task.id)
    assert [e["to_status"] for e in history].count("SUCCEEDED") == 1
    assert [e["attempt"] for e in history if e["from_status"] != "PROCESSING" and e["to_status"] == "PROCESSING"] == [1]
    await wait_consumer_empty(backends, SLEEPY, Priority.NORMAL)


async def test_paused_workers_late_result_is_fenced_out(
    settings: Settings, backends: Backends, workers: Factory
) -> None:
    # outputs stored, not inline in the row: the test is about a fenced run's stored output
    base = with_(
        sleepy_settings(settings, sleep=0.3), lease_seconds=2.0, heartbeat_seconds=0.5, result_inline_max_bytes=0
    )
    # A worker that stops renewing (a long pause): its lease and ack wait lapse while it still runs.
    paused = await workers(
        sleepy_settings(base, sleep=5.0).model_copy(update={"heartbeat_seconds": 60.0, "lease_seconds": 1.0}),
        worker_id="paused",
    )
    task = await submit(backends, params=params(steps=1))
    await wait_task(backends, task.id, lambda r: r.status is Status.PROCESSING and r.worker_id == "paused")
    healthy = await workers(base, worker_id="healthy")
    row = await wait_task(backends, task.id, is_status(Status.SUCCEEDED), within=20)
    assert (row.attempt, row.worker_id) == (2, "healthy")
    fenced = await paused.worker.signals.reported.wait_for(report_for(task.id), within=20)
    assert fenced.outcome == "fenced" and fenced.attempt == 1
    store_ = results.result_store(base, backends.bus)
    # the fenced run cleaned up its own output, never the one that replaced it
    assert [
        f"nats-os://{busmod.RESULTS_BUCKET}/{name}" for name in await stored_objects(backends.bus, f"{task.id}-")
    ] == [row.result_uri]
    assert len(b"".join([c async for c in store_.read(row.result_uri or "")])) == row.result_size
    final = await store.get_task(backends.pool, task.id)
    assert final is not None and final.result_uri == row.result_uri and final.version == row.version
    assert healthy.worker_id == "healthy"


async def test_drain_releases_running_work_after_the_grace(
    settings: Settings, backends: Backends, workers: Factory, operator: Operator
) -> None:
    s = with_(sleepy_settings(settings, sleep=30.0), worker_admin_target=operator.target)
    handle = await workers(s, worker_id="draining")
    task = await submit(backends, params=params(steps=30))
    await wait_task(backends, task.id, is_status(Status.PROCESSING))
    started = time.monotonic()
    async with grpc.aio.insecure_channel(f"127.0.0.1:{handle.port}") as channel:
        reply = await worker_pb2_grpc.WorkerControlStub(channel).Drain(
            worker_pb2.DrainRequest(grace=Duration(nanos=300_000_000)), metadata=operator.metadata
        )
    assert reply.draining and reply.running == 1
    await handle.worker.drain_requested.wait()
    report = await handle.worker.signals.reported.wait_for(report_for(task.id), within=5)
    assert report.outcome == "released" and time.monotonic() - started >= 0.3
    row = await store.get_task(backends.pool, task.id)
    assert row is not None and (row.status, row.attempt, row.worker_id) == (Status.QUEUED, 1, None)
    await handle.stop()
    assert await backends.pool.fetchval("SELECT count(*) FROM worker WHERE id = 'draining'") == 0

    await workers(sleepy_settings(settings, sleep=0.05), worker_id="next")
    done = await wait_task(backends, task.id, is_status(Status.SUCCEEDED))
    assert (done.attempt, done.worker_id) == (2, "next")


async def test_drain_lets_a_task_finish_within_the_grace(
    settings: Settings, backends: Backends, workers: Factory
) -> None:
    handle = await workers(sleepy_settings(settings, sleep=0.4))
    task = await submit(backends, params=params(steps=2))
    await wait_task(backends, task.id, is_status(Status.PROCESSING))
    await handle.stop(grace=5.0)
    row = await store.get_task(backends.pool, task.id)
    assert row is not None and (row.status, row.attempt) == (Status.SUCCEEDED, 1)


async def test_sigterm_drains_and_exits_zero(settings: Settings, backends: Backends, tmp_path: Path) -> None:
    s = sleepy_settings(settings, sleep=30.0)
    env = dict(os.environ)
    env.update(
        {
            "TASKGATE_DATABASE_URL": s.database_url or "",
            "TASKGATE_NATS_URL": s.nats_url or "",
            "TASKGATE_STATE_DIR": str(tmp_path),
            "TASKGATE_MODELS": json.dumps({SLEEPY: {"kind": "sleep", "sleep_seconds": 30.0}}),
            "TASKGATE_DEFAULT_MODEL": SLEEPY,
            "TASKGATE_WORKER_ID": "subprocess",
            "TASKGATE_WORKER_PORT": "0",
            "TASKGATE_WORKER_METRICS_PORT": "0",
            "TASKGATE_DRAIN_GRACE_SECONDS": "0.2",
        }
    )
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "services.worker",
        env=env,
        cwd=ROOT,
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        task = await submit(backends, params=params(steps=30))
        await wait_task(backends, task.id, is_status(Status.PROCESSING), within=30)
        proc.send_signal(signal.SIGTERM)
        _, stderr = await asyncio.wait_for(proc.communicate(), 20)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    assert proc.returncode == 0, stderr.decode()[-2000:]
    row = await store.get_task(backends.pool, task.id)
    assert row is not None and (row.status, row.attempt, row.worker_id) == (Status.QUEUED, 1, None)
    assert await backends.pool.fetchval("SELECT count(*) FROM worker WHERE id = 'subprocess'") == 0
    lines = [json.loads(line) for line in stderr.decode().splitlines() if line.startswith("{")]
    assert any(line.get("msg") == "task handled" and line.get("outcome") == "released" for line in lines)


async def test_high_priority_task_behind_twenty_low_ones_starts_next(
    settings: Settings, backends: Backends, workers: Factory
) -> None:
    await workers(sleepy_settings(settings, sleep=0.15))
    first, *_ = [await submit(backends, priority=Priority.LOW, params=params(steps=1, seed=i)) for i in range(20)]
    count_low = "SELECT count(*) FROM task WHERE priority = 1 AND started_at < $1"
    far = datetime.now(UTC) + timedelta(days=1)
    await wait_task(backends, first.id, lambda r: r.started_at is not None)
    before = await backends.pool.fetchval(count_low, far)
    high = await submit(backends, priority=Priority.HIGH, params=params(steps=1, seed=99))
    done = await wait_task(backends, high.id, is_status(Status.SUCCEEDED))
    assert before < 10  # most LOW tasks were still waiting
    # Only LOW tasks already claimed when HIGH arrived ran before it (plus one claimed in that instant).
    assert await backends.pool.fetchval(count_low, done.started_at) <= before + 1


async def test_model_cap_holds_across_two_workers(settings: Settings, backends: Backends, workers: Factory) -> None:
    s = with_(sleepy_settings(settings, sleep=0.2, max_concurrency=1), worker_slots=2)
    first, second = await workers(s, worker_id="w1"), await workers(s, worker_id="w2")
    tasks = [await submit(backends, params=params(steps=1, seed=i)) for i in range(4)]
    rows = [await wait_task(backends, t.id, is_status(Status.SUCCEEDED), within=15) for t in tasks]
    # History times are clock times inside each write (started_at is the claim transaction's start).
    spans = []
    for row in rows:
        history = await events(backends, row.id)
        claimed = [e["at"] for e in history if e["to_status"] == "PROCESSING" and e["from_status"] != "PROCESSING"]
        finished = [e["at"] for e in history if e["to_status"] == "SUCCEEDED"]
        spans.append((claimed[-1], finished[0]))
    spans.sort()
    assert all(a[1] < b[0] for a, b in itertools.pairwise(spans))
    capped = [r for w in (first, second) for r in w.worker.signals.reported.seen if r.outcome == "capped"]
    assert capped  # the cap was exercised, not just unneeded
    assert {r.worker_id for r in rows} <= {"w1", "w2"}
    await wait_consumer_empty(backends, SLEEPY, Priority.NORMAL)


async def test_reusable_result_query_is_guarded_by_attempt(settings: Settings, backends: Backends) -> None:
    task = await insert_task(backends.pool, model_id=SLEEPY)
    await claimed(backends.pool, task.id, worker_id="w", lease_seconds=5.0)
    assert (await store.cancel(backends.pool, task.id, mode=CancelMode.SOFT, actor="submit")).applied
    output = ResultRef("nats-os://b/x", "application/json", 3, "abc")
    assert not await registry.keep_reusable(backends.pool, task.id, attempt=2, result=output)
    assert await registry.keep_reusable(backends.pool, task.id, attempt=1, result=output)
    kept = await backends.pool.fetchrow("SELECT * FROM reusable_result WHERE source_task_id = $1", task.id)
    assert kept is not None and (kept["result_uri"], kept["result_size"]) == (output.uri, output.size)


async def test_a_level_just_taken_from_pulls_again_at_once(
    settings: Settings, backends: Backends, workers: Factory
) -> None:
    # pulls linger 30 s and tasks run 12: a message left waiting for another level's pull to expire, or for a slot to
    # free, would miss the 5 s bound below
    await workers(with_(sleepy_settings(settings, sleep=12.0), worker_slots=2, worker_fetch_linger_seconds=30.0))

    async def lingering() -> bool:
        infos = [
            await backends.bus.js.consumer_info(busmod.TASKS_STREAM, busmod.consumer_name(SLEEPY, p))
            for p in (Priority.HIGH, Priority.NORMAL, Priority.LOW)
        ]
        return all(info.num_waiting for info in infos)

    await wait_for(lingering, within=10)  # the idle worker has a pull outstanding on every priority
    first = await submit(backends, priority=Priority.HIGH, params=params(steps=1, seed=1))
    await wait_task(backends, first.id, is_status(Status.PROCESSING))  # taken from the HIGH pull's delivery
    second = await submit(backends, priority=Priority.HIGH, params=params(steps=1, seed=2))
    await wait_task(backends, second.id, is_status(Status.PROCESSING), within=5)


async def test_a_workers_claim_says_why_not_and_commits_durably(backends: Backends) -> None:
    pool = backends.pool
    task, other = [await insert_task(pool, model_id=SLEEPY, prompt=f"p{n}") for n in range(2)]

    async def claim(task_id: int, *, model: str = SLEEPY, cap: int = 0, worker: str = "w1") -> registry.WorkerClaim:
        return await registry.claim_for(
            pool, task_id, model_id=model, cap=cap, worker_id=worker, lease_seconds=10.0, actor=worker
        )

    assert (await claim(-1)).verdict is registry.Verdict.NOT_FOUND
    assert (await claim(task.id, model="another")).verdict is registry.Verdict.OTHER_MODEL
    got = await claim(task.id)
    assert got.verdict is registry.Verdict.CLAIMED and got.task is not None
    assert (got.task.status, got.task.attempt, got.task.worker_id, got.from_status) == (
        Status.PROCESSING,
        1,
        "w1",
        task.status,
    )
    assert (await claim(other.id, cap=1)).verdict is registry.Verdict.CAPPED
    assert (await store.queue(pool, other.id, actor="submit")).applied
    async with pool.acquire() as conn, conn.transaction():
        # a message is a hint for its level: a redelivery of the running task's message claims the one still queued
        got = await registry.claim_for(
            conn, task.id, model_id=SLEEPY, cap=2, worker_id="w2", lease_seconds=10.0, actor="w2"
        )
        assert got.verdict is registry.Verdict.CLAIMED and got.task is not None and got.task.id == other.id
        # durable: a claim lost in a crash would hand its attempt number (the fencing token) to a second worker
        assert await conn.fetchval("SHOW synchronous_commit") == "on"
    refused = await claim(task.id, worker="w3")  # nothing queued, and its own task's lease is live
    assert refused.verdict is registry.Verdict.REFUSED and refused.task is not None and refused.task.worker_id == "w1"
    for done in (task, other):
        assert (await store.cancel(pool, done.id, mode=CancelMode.HARD, actor="test")).applied
    assert (await claim(task.id)).verdict is registry.Verdict.FINISHED  # nothing queued in its level: a spare message


async def test_worker_control_answers_admin_keys_only_as_taskadmin_vouches(
    settings: Settings, backends: Backends, workers: Factory, operator: Operator
) -> None:
    handle = await workers(with_(sleepy_settings(settings), worker_admin_target=operator.target), worker_id="guarded")
    tenant = await key_for(backends)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{handle.port}") as channel:
        control = worker_pb2_grpc.WorkerControlStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as nobody:
            await control.GetStatus(worker_pb2.GetStatusRequest())
        assert nobody.value.code() is grpc.StatusCode.UNAUTHENTICATED and "admin key" in (nobody.value.details() or "")
        with pytest.raises(grpc.aio.AioRpcError) as wrong:
            await control.GetStatus(worker_pb2.GetStatusRequest(), metadata=(("authorization", "Bearer tg_made_up"),))
        assert wrong.value.code() is grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.aio.AioRpcError) as tenant_drain:
            await control.Drain(worker_pb2.DrainRequest(), metadata=tenant)
        assert tenant_drain.value.code() is grpc.StatusCode.PERMISSION_DENIED, tenant_drain.value
        assert "admin" in (tenant_drain.value.details() or "") and not handle.worker.draining
        status = await control.GetStatus(worker_pb2.GetStatusRequest(), metadata=operator.metadata)
        assert status.worker_id == "guarded"
        reply = await control.Drain(worker_pb2.DrainRequest(), metadata=operator.metadata)
    assert reply.draining and handle.worker.draining
    audited = await backends.pool.fetch("SELECT admin, action, target FROM admin_audit")
    assert [tuple(r) for r in audited] == [("ops", "worker.drain", "guarded")]  # a status check is no action

    # TaskAdmin out of reach: the check cannot be made, so nothing is answered
    lone = await workers(with_(sleepy_settings(settings), worker_admin_target="127.0.0.1:1"), worker_id="lone")
    async with grpc.aio.insecure_channel(f"127.0.0.1:{lone.port}") as channel:
        with pytest.raises(grpc.aio.AioRpcError) as cut_off:
            await worker_pb2_grpc.WorkerControlStub(channel).Drain(
                worker_pb2.DrainRequest(), metadata=operator.metadata
            )
    assert cut_off.value.code() is grpc.StatusCode.UNAVAILABLE and not lone.worker.draining
