"""The scheduler's scans on real PostgreSQL and NATS, driven by an injected clock instead of sleeps."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import time
from datetime import timedelta

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client import REGISTRY

from services.scheduler import service
from services.scheduler.scans import Action
from services.scheduler.service import Scheduler
from taskgate import bus as busmod
from taskgate import store
from taskgate.config import ModelSpec, Settings
from taskgate.model import TaskRow
from taskgate.runtime import Backends, connect
from taskgate.states import Status
from taskgate.store import Rejection
from taskgate.wire import dispatch
from taskgate_api.v1 import task_pb2
from taskgate_local.embedded import free_port
from tests.support.factories import MEM_RESULT, all_settings, claimed, put_in
from tests.support.harness import wait_for
from tests.support.queries import db_now, dispatches, row


@pytest.fixture
def scheduler(backends: Backends) -> Scheduler:
    return Scheduler(all_settings(backends), backends.pool, backends.bus)


async def test_lost_publish_is_repaired(backends: Backends, scheduler: Scheduler) -> None:
    task = await put_in(backends.pool, Status.CREATED)  # the submit service crashed before its publish
    now = await db_now(backends.pool)

    timeout = scheduler.settings.created_timeout_seconds
    early = await scheduler.run_once(now + timedelta(seconds=timeout - 1))
    assert early[Action.QUEUE] == 0 and (await row(backends.pool, task.id)).status is Status.CREATED

    report = await scheduler.run_once(now + timedelta(seconds=timeout + 1))
    assert report[Action.QUEUE] == 1 and not report.failed
    after = await row(backends.pool, task.id)
    assert (after.status, after.version, after.last_actor) == (Status.QUEUED, task.version + 1, "scheduler")
    assert after.queued_at is not None
    [(subject, msg_id, dispatch)] = await dispatches(backends.bus)
    assert subject == busmod.task_subject("wan-tiny", 5) and msg_id == f"{task.id}.q0"
    assert dispatch.task_id == str(task.id) and dispatch.model_id == "wan-tiny"


async def test_failed_publish_leaves_the_task_for_the_next_pass(backends: Backends, scheduler: Scheduler) -> None:
    task = await put_in(backends.pool, Status.CREATED)
    await backends.bus.js.delete_stream(busmod.TASKS_STREAM)  # every publish now fails
    later = await db_now(backends.pool) + timedelta(seconds=31)

    report = await scheduler.run_once(later)
    assert report[Action.QUEUE] == 0
    assert (await row(backends.pool, task.id)).version == task.version

    await busmod.declare(backends.bus, backends.settings)
    assert (await scheduler.run_once(later))[Action.QUEUE] == 1
    assert (await row(backends.pool, task.id)).status is Status.QUEUED


async def dead_notice(backends: Backends, task: TaskRow) -> tuple[str, str]:
    """The reason and error code of the latest notice on the dead-letter stream for the task's model (it must be this
    task's)."""
    msg = await backends.bus.js.get_last_msg(busmod.DEAD_STREAM, busmod.dead_subject(task.model_id))
    notice = json.loads(msg.data or b"{}")
    assert notice["task_id"] == str(task.id) and msg.headers and msg.headers.get("Nats-Msg-Id") == f"{task.id}.dead"
    return notice["reason"], notice["error_code"]


async def test_queue_timeout_republishes_only_a_missing_message_then_times_out(
    backends: Backends, scheduler: Scheduler
) -> None:
    task = await put_in(backends.pool, Status.QUEUED)  # queued, but its message never reached the stream
    now = await db_now(backends.pool)
    assert (await scheduler.run_once(now + timedelta(seconds=179))).actions.total() == 0

    now = await db_now(backends.pool)
    report = await scheduler.run_once(now + timedelta(seconds=181))
    assert (report[Action.REPUBLISH], report[Action.STILL_QUEUED], report[Action.QUEUE_TIMEOUT]) == (1, 0, 0)
    # the next round finds its message in the stream: nothing is sent beside it, the task is only marked
    now = await db_now(backends.pool)
    report = await scheduler.run_once(now + timedelta(seconds=181))
    assert (report[Action.REPUBLISH], report[Action.STILL_QUEUED], report[Action.QUEUE_TIMEOUT]) == (0, 1, 0)
    current = await row(backends.pool, task.id)
    assert (current.status, current.publish_count, current.version) == (Status.QUEUED, 2, task.version + 2)

    now = await db_now(backends.pool)
    report = await scheduler.run_once(now + timedelta(seconds=181))
    assert report[Action.QUEUE_TIMEOUT] == 1 and report[Action.REPUBLISH] == 0
    final = await row(backends.pool, task.id)
    assert (final.status, final.error_code) == (Status.TIMEOUT, "QUEUE_TIMEOUT")
    dead = await backends.pool.fetchrow("SELECT * FROM dead_letter WHERE task_id = $1", task.id)
    assert dead is not None and dead["error_code"] == "QUEUE_TIMEOUT"
    assert await dead_notice(backends, task) == ("queue timeout", "QUEUE_TIMEOUT")  # the stream too, not only the table
    assert [m for _, m, _ in await dispatches(backends.bus)] == [f"{task.id}.p{task.version + 1}"]


async def test_a_queue_that_moves_never_times_out_and_a_lost_message_is_resent_once_it_stops(
    backends: Backends, scheduler: Scheduler
) -> None:
    pool = backends.pool
    running = await put_in(pool, Status.PROCESSING, lease=600.0)  # the model is busy: a backlog, not a loss
    kept, lost = [await put_in(pool, Status.QUEUED) for _ in range(2)]
    await dispatch.publish(backends.bus, kept, dispatch.Reason.SUBMITTED)  # only one of the two has its message
    now = await db_now(pool)
    assert (await scheduler.run_once(now + timedelta(seconds=200))).actions.total() == 0
    assert (await store.succeed(pool, running.id, attempt=1, result=MEM_RESULT, actor="w1")).applied
    # a claim at the model a moment ago counts as moving too, for the queue timeout from that claim
    await pool.execute(
        "INSERT INTO fair_level (model_id, priority, floor, claimed_at) VALUES ('wan-tiny', 5, 0, $1)"
        " ON CONFLICT (model_id, priority) DO UPDATE SET claimed_at = excluded.claimed_at", now,
    )
    assert (await scheduler.run_once(now + timedelta(seconds=179))).actions.total() == 0
    report = await scheduler.run_once(now + timedelta(seconds=181))  # it stopped: one message is missing, one sent
    assert (report[Action.REPUBLISH], report[Action.STILL_QUEUED]) == (1, 1)
    consumer = await backends.bus.js.consumer_info(busmod.TASKS_STREAM, busmod.consumer_name("wan-tiny", 5))
    assert consumer.num_pending == 2  # as many messages as queued tasks, not one per task per round
    assert {(await row(pool, t.id)).publish_count for t in (kept, lost)} == {1}


async def test_queue_timeout_is_per_model(settings: Settings) -> None:
    models = dict(settings.models)
    models["sleepy"] = ModelSpec(kind="sleep", queue_timeout_seconds=5)
    b = await connect(settings.model_copy(update={"models": models}), "test")
    try:
        sched = Scheduler(all_settings(b), b.pool, b.bus)
        fast = await put_in(b.pool, Status.QUEUED, model_id="sleepy")
        slow = await put_in(b.pool, Status.QUEUED, model_id="wan-tiny")
        report = await sched.run_once(await db_now(b.pool) + timedelta(seconds=6))
        assert report[Action.REPUBLISH] == 1
        assert (await row(b.pool, fast.id)).publish_count == 1 and (await row(b.pool, slow.id)).publish_count == 0
    finally:
        await b.close()


async def test_retry_backoff_delays_the_queue_timeout(backends: Backends, scheduler: Scheduler) -> None:
    task = await put_in(backends.pool, Status.PROCESSING)
    out = await store.retry(
        backends.pool, task.id, attempt=1, error=store.TaskError("E", "flaky"), delay_seconds=120.0, actor="test"
    )
    assert out.applied
    now = await db_now(backends.pool)
    assert (await scheduler.run_once(now + timedelta(seconds=181)))[Action.REPUBLISH] == 0  # still backing off
    assert (await scheduler.run_once(now + timedelta(seconds=120 + 181)))[Action.REPUBLISH] == 1


async def test_expired_lease_requeues_and_fences_out_the_old_attempt(backends: Backends, scheduler: Scheduler) -> None:
    task = await put_in(backends.pool, Status.PROCESSING, lease=10.0)
    now = await db_now(backends.pool)
    assert (await scheduler.run_once(now + timedelta(seconds=9)))[Action.RELEASE] == 0  # lease still live

    report = await scheduler.run_once(now + timedelta(seconds=11))
    assert report[Action.RELEASE] == 1
    released = await row(backends.pool, task.id)
    assert (released.status, released.worker_id, released.attempt) == (Status.QUEUED, None, 1)
    assert [m for _, m, _ in await dispatches(backends.bus)] == [f"{task.id}.a1"]

    # the old worker wakes up and writes its result: refused, the task is not its any more
    late = await store.succeed(backends.pool, task.id, attempt=1, result=MEM_RESULT, actor="w1")
    assert late.rejection is Rejection.ILLEGAL
    again = await claimed(backends.pool, task.id, worker_id="w2", lease_seconds=10.0)
    assert again.attempt == 2
    late = await store.succeed(backends.pool, task.id, attempt=1, result=MEM_RESULT, actor="w1")
    assert late.rejection is Rejection.STALE
    done = await store.succeed(backends.pool, task.id, attempt=2, result=MEM_RESULT, actor="w2")
    assert done.applied


async def test_slow_but_alive_worker_gets_one_grace_then_timeout_and_cancel(
    backends: Backends, scheduler: Scheduler
) -> None:
    s = all_settings(backends)
    task = await put_in(backends.pool, Status.PROCESSING)
    assert task.started_at is not None
    sub = await backends.bus.nc.subscribe(busmod.CANCEL_SUBJECT)
    await backends.bus.nc.flush()

    async def heartbeat() -> None:  # the worker is alive: its lease always covers the injected clock
        assert await store.renew_lease(backends.pool, task.id, attempt=task.attempt, lease_seconds=100_000)

    await heartbeat()
    past_timeout = task.started_at + timedelta(seconds=s.processing_timeout_seconds + 1)
    report = await scheduler.run_once(past_timeout)
    assert report[Action.GRACE] == 1 and report[Action.PROCESSING_TIMEOUT] == 0
    graced = await row(backends.pool, task.id)
    assert graced.timeout_extended and graced.status is Status.PROCESSING and graced.version == task.version

    await heartbeat()
    within_grace = past_timeout + timedelta(seconds=s.processing_grace_seconds - 2)
    assert (await scheduler.run_once(within_grace)).actions.total() == 0

    report = await scheduler.run_once(past_timeout + timedelta(seconds=s.processing_grace_seconds + 1))
    assert report[Action.PROCESSING_TIMEOUT] == 1 and report[Action.GRACE] == 0
    final = await row(backends.pool, task.id)
    assert (final.status, final.error_code) == (Status.TIMEOUT, "PROCESSING_TIMEOUT")
    assert await backends.pool.fetchval("SELECT count(*) FROM dead_letter WHERE task_id = $1", task.id) == 1
    assert await dead_notice(backends, task) == ("processing timeout", "PROCESSING_TIMEOUT")
    signal = task_pb2.CancelSignal.FromString((await sub.next_msg(timeout=5)).data)
    assert (signal.task_id, signal.hard) == (str(task.id), True)
    # the worker learns it too
    assert not await store.renew_lease(backends.pool, task.id, attempt=task.attempt, lease_seconds=10)
    await sub.unsubscribe()


async def test_two_replicas_never_double_requeue(settings: Settings) -> None:
    s = settings.model_copy(update={"scan_batch_size": 25})
    a, b = await connect(s, "scheduler-a"), await connect(s, "scheduler-b")
    try:
        tasks = [await put_in(a.pool, Status.PROCESSING, lease=10.0) for _ in range(200)]
        later = await db_now(a.pool) + timedelta(seconds=11)
        first, second = Scheduler(s, a.pool, a.bus), Scheduler(s, b.pool, b.bus)
        moved = {"a": 0, "b": 0}
        while True:
            ra, rb = await asyncio.gather(first.run_once(later), second.run_once(later))
            assert not ra.failed and not rb.failed
            moved["a"] += ra[Action.RELEASE]
            moved["b"] += rb[Action.RELEASE]
            if ra.actions.total() + rb.actions.total() == 0:
                break
        assert moved["a"] + moved["b"] == 200
        assert moved["a"] > 0 and moved["b"] > 0, moved  # both replicas really worked at the same time
        rows = await a.pool.fetch(
            "SELECT task_id, count(*) AS n FROM task_event WHERE task_id = ANY($1::bigint[]) AND version > $2 GROUP BY "
            "task_id",
            [t.id for t in tasks], tasks[0].version,
        )
        assert len(rows) == 200 and all(r["n"] == 1 for r in rows)
        msg_ids = [m for _, m, _ in await dispatches(a.bus)]
        assert sorted(msg_ids) == sorted(dispatch.msg_id(t, dispatch.Reason.RELEASED) for t in tasks)
    finally:
        await a.close()
        await b.close()


async def test_exhausted_failures_get_a_dead_letter(backends: Backends, scheduler: Scheduler) -> None:
    exhausted = await put_in(backends.pool, Status.FAILED, max_retries=0)
    retryable = await put_in(backends.pool, Status.FAILED, max_retries=3)
    report = await scheduler.run_once()
    assert report[Action.DEAD_LETTER] == 1
    dead = await backends.pool.fetch("SELECT * FROM dead_letter")
    assert [(d["task_id"], d["error_code"], d["error_msg"]) for d in dead] == [(exhausted.id, "BOOM", "it broke")]
    assert retryable.id not in {d["task_id"] for d in dead}
    assert (await scheduler.run_once())[Action.DEAD_LETTER] == 0


async def test_silent_workers_are_forgotten(backends: Backends, scheduler: Scheduler) -> None:
    await backends.pool.execute(
        "INSERT INTO worker (id, models, slots, device, last_heartbeat) VALUES "
        "('gone', '{wan-tiny}', 1, 'cpu', now() - interval '101 seconds'), ('here', '{wan-tiny}', 1, 'cpu', now())"
    )
    report = await scheduler.run_once()
    assert report[Action.FORGET_WORKER] == 1
    assert [r["id"] for r in await backends.pool.fetch("SELECT id FROM worker")] == ["here"]


async def test_gauges_per_model(backends: Backends, scheduler: Scheduler) -> None:
    await put_in(backends.pool, Status.PROCESSING, model_id="sleepy")  # first: the claim takes the level's oldest
    for _ in range(3):
        await put_in(backends.pool, Status.QUEUED, model_id="sleepy")
    await put_in(backends.pool, Status.SUCCEEDED, model_id="wan-tiny")
    await backends.pool.execute("UPDATE task SET queued_at = now() - interval '42 seconds' WHERE status = 'QUEUED'")
    await backends.pool.execute("INSERT INTO worker (id, models, slots, device) VALUES ('w1', '{sleepy}', 1, 'cpu')")
    await scheduler.refresh_gauges()

    def value(name: str, model: str | None = None) -> float | None:
        return REGISTRY.get_sample_value(name, {"model": model} if model else {})

    assert value("taskgate_queue_depth", "sleepy") == 3 and value("taskgate_queue_depth", "wan-tiny") == 0
    assert value("taskgate_tasks_processing", "sleepy") == 1
    oldest = value("taskgate_queue_oldest_age_seconds", "sleepy")
    assert oldest is not None and 42 <= oldest < 60
    assert value("taskgate_workers_alive") == 1


async def test_actions_are_counted(backends: Backends, scheduler: Scheduler) -> None:
    before = REGISTRY.get_sample_value("taskgate_scheduler_actions_total", {"action": "release"}) or 0.0
    await put_in(backends.pool, Status.PROCESSING)
    await scheduler.run_once(await db_now(backends.pool) + timedelta(seconds=11))
    assert REGISTRY.get_sample_value("taskgate_scheduler_actions_total", {"action": "release"}) == before + 1


async def test_scan_loop_recovers_a_dead_workers_task_within_lease_plus_interval(settings: Settings) -> None:
    s = settings.model_copy(update={"lease_seconds": 1.0, "heartbeat_seconds": 0.25, "scan_interval_seconds": 0.2})
    handle = await service.start(s)
    try:
        pool = handle.backends.pool
        task = await put_in(pool, Status.PROCESSING, lease=s.lease_seconds)  # the worker dies right after its claim
        started = time.monotonic()

        async def requeued() -> bool:
            return (await row(pool, task.id)).status is Status.QUEUED

        await wait_for(requeued, within=15)
        # lease + one interval, with room for a loaded machine; a missed scan would take the 15 s above
        assert time.monotonic() - started < s.lease_seconds + s.scan_interval_seconds + 3.0
        assert handle.scheduler.passes >= 2
    finally:
        await handle.stop()


async def test_runs_as_its_own_process_and_stops_on_sigterm(settings: Settings) -> None:
    port = free_port()
    env = {
        **os.environ,
        "TASKGATE_DATABASE_URL": settings.database_url or "",
        "TASKGATE_NATS_URL": settings.nats_url or "",
        "TASKGATE_STATE_DIR": str(settings.state_dir),
        "TASKGATE_SCHEDULER_PORT": str(port),
        "TASKGATE_SCHEDULER_METRICS_PORT": "0",
    }
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "services.scheduler", env=env, stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            health = health_pb2_grpc.HealthStub(channel)

            async def serving() -> bool:
                try:
                    reply = await health.Check(
                        health_pb2.HealthCheckRequest(service="taskgate.v1.TaskAdmin"), timeout=1
                    )
                except grpc.aio.AioRpcError:
                    return False
                return reply.status == health_pb2.HealthCheckResponse.SERVING

            await wait_for(serving, within=30)
        proc.send_signal(signal.SIGTERM)
        _, stderr = await asyncio.wait_for(proc.communicate(), 15)
        assert proc.returncode == 0, stderr.decode()[-2000:]
        assert b'"msg": "stopped"' in stderr
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
