"""Poison tasks: attempts whose worker was lost are counted, and the processing timeout covers every attempt."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sys
from collections.abc import AsyncIterator
from datetime import timedelta
from pathlib import Path

import asyncpg
import pytest

from services.scheduler import service as scheduler_service
from services.scheduler.scans import WORKER_LOST, Action
from services.scheduler.service import Scheduler
from taskgate import auth, store
from taskgate import bus as busmod
from taskgate.config import Settings
from taskgate.model import TaskRow
from taskgate.runtime import Backends
from taskgate.states import Status
from taskgate.store import workers as registry
from taskgate.store.workers import Verdict
from taskgate.wire import dispatch
from tests.support import factories, sleepy
from tests.support.factories import SLEEPY as SLEEP_MODEL
from tests.support.factories import all_settings, insert_task, params, publish, sleepy_settings, submit
from tests.support.harness import ROOT, WorkerFactory, settings_env, wait_for
from tests.support.queries import db_now, row

SLEEPY = "sleepy"
POISON = "POISON-PILL"


@pytest.fixture
def scheduler(backends: Backends) -> Scheduler:
    return Scheduler(all_settings(backends), backends.pool, backends.bus)


async def claimed(pool: asyncpg.Pool, task_id: int, worker: str, lease: float = 10.0) -> TaskRow:
    return await factories.claimed(pool, task_id, worker_id=worker, lease_seconds=lease, max_worker_losses=2)


async def dead_notices(bus: busmod.Bus) -> list[dict[str, object]]:
    """Every notice on the dead-letter stream, read without consuming."""
    info = await bus.js.stream_info(busmod.DEAD_STREAM)
    if info.state.messages == 0:
        return []
    notices = []
    for seq in range(info.state.first_seq, info.state.last_seq + 1):
        msg = await bus.js.get_msg(busmod.DEAD_STREAM, seq)
        notices.append(json.loads(msg.data or b"{}"))
    return notices


async def test_each_lost_attempt_is_counted_and_the_last_allowed_one_fails_the_task(
    backends: Backends, scheduler: Scheduler
) -> None:
    pool = backends.pool
    task = await insert_task(pool)
    assert (await store.queue(pool, task.id, actor="submit")).applied
    await claimed(pool, task.id, "w1")
    now = await db_now(pool)
    assert (await scheduler.run_once(now + timedelta(seconds=11)))[Action.RELEASE] == 1
    released = await row(pool, task.id)
    assert (released.status, released.worker_losses, released.attempt) == (Status.QUEUED, 1, 1)
    assert released.processed_seconds > 0  # the lost attempt's time counts toward the processing timeout

    await claimed(pool, task.id, "w2")
    now = await db_now(pool)
    report = await scheduler.run_once(now + timedelta(seconds=11))
    assert (report[Action.RELEASE], report[Action.WORKER_LOST]) == (0, 1)
    failed = await row(pool, task.id)
    assert (failed.status, failed.error_code, failed.worker_losses, failed.attempt) == (
        Status.FAILED,
        WORKER_LOST,
        2,
        2,
    )
    letter = await pool.fetchrow("SELECT * FROM dead_letter WHERE task_id = $1", task.id)
    assert letter is not None and (letter["reason"], letter["error_code"]) == ("worker lost", WORKER_LOST)
    [notice] = await dead_notices(backends.bus)
    assert (notice["task_id"], notice["error_code"]) == (str(task.id), WORKER_LOST)


async def test_a_claim_taking_over_a_lost_attempt_counts_it_and_refuses_the_last_one(backends: Backends) -> None:
    pool = backends.pool
    task = await insert_task(pool)
    await claimed(pool, task.id, "w1", lease=-1.0)  # a lease that has already run out: the worker is gone
    taken = await claimed(pool, task.id, "w2", lease=-1.0)  # the redelivered message beat the scheduler's scan
    assert (taken.attempt, taken.worker_losses) == (2, 1)
    refused = await factories.claim(pool, task.id, worker_id="w3", lease_seconds=10.0, max_worker_losses=2)
    assert refused.verdict is Verdict.REFUSED
    assert refused.task is not None and (refused.task.status, refused.task.attempt) == (Status.PROCESSING, 2)
    unlimited = await factories.claimed(pool, task.id, worker_id="w3", lease_seconds=10.0)
    assert unlimited.worker_losses == 2


async def test_processing_timeout_counts_earlier_attempts(backends: Backends, scheduler: Scheduler) -> None:
    pool, s = backends.pool, all_settings(backends)
    task = await insert_task(pool)
    await claimed(pool, task.id, "w1")
    assert (await store.release(pool, task.id, actor="test", worker_lost=False)).applied
    # an earlier attempt ran for most of the timeout
    await pool.execute(
        "UPDATE task SET processed_seconds = $2 WHERE id = $1", task.id, s.processing_timeout_seconds - 50
    )
    running = await claimed(pool, task.id, "w2")
    assert running.started_at is not None and running.worker_losses == 0
    assert await store.renew_lease(pool, task.id, attempt=running.attempt, lease_seconds=100_000)

    start = running.started_at
    assert (await scheduler.run_once(start + timedelta(seconds=49)))[Action.GRACE] == 0
    assert (await scheduler.run_once(start + timedelta(seconds=51)))[Action.GRACE] == 1
    late = start + timedelta(seconds=51 + s.processing_grace_seconds)
    assert (await scheduler.run_once(late))[Action.PROCESSING_TIMEOUT] == 1
    assert (await row(pool, task.id)).status is Status.TIMEOUT


# ---- a task that kills its worker, end to end ----


@contextlib.asynccontextmanager
async def worker_kept_running(settings: Settings) -> AsyncIterator[list[int]]:
    """A worker process started again each time it dies, like a supervisor; yields the list of its exit codes."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TASKGATE_")} | settings_env(settings)
    exits: list[int] = []
    current: list[asyncio.subprocess.Process] = []

    async def supervise() -> None:
        while True:
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "services.worker", env=env, cwd=ROOT,
                stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL,
            )
            current[:] = [proc]
            exits.append(await proc.wait())

    keeper = asyncio.create_task(supervise())
    try:
        yield exits
    finally:
        keeper.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await keeper
        for proc in current:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()


async def test_a_task_that_kills_its_worker_ends_failed_worker_lost_and_others_keep_flowing(
    settings: Settings, backends: Backends, tmp_path: Path
) -> None:
    s = settings.model_copy(
        update={
            "models": {SLEEPY: sleepy.spec(0.2, default_steps=2, kill_on_prompt=POISON)},
            "default_model": SLEEPY,
            "worker_models": [SLEEPY],
            "worker_slots": 1,
            "lease_seconds": 1.0,
            "heartbeat_seconds": 0.25,
            "scan_interval_seconds": 0.2,
            "max_worker_losses": 2,
        }
    )
    sched = await scheduler_service.start(s, backends)
    tasks = []
    for n in range(7):
        prompt = f"{POISON} in the prompt" if n == 1 else f"a harmless prompt {n}"
        task = await insert_task(backends.pool, model_id=SLEEPY, prompt=prompt, params={"num_inference_steps": 2})
        await backends.bus.js.publish(
            busmod.task_subject(SLEEPY, task.priority), dispatch.encode(task), headers={"Nats-Msg-Id": f"{task.id}.q0"}
        )
        assert (await store.queue(backends.pool, task.id, actor="submit")).applied
        tasks.append(task)
    poison, others = tasks[1], tasks[:1] + tasks[2:]

    async def all_finished() -> bool:
        rows = [await row(backends.pool, t.id) for t in tasks]
        return all(r.status.terminal for r in rows)

    try:
        async with worker_kept_running(s) as exits:
            await wait_for(all_finished, within=90, every=0.1)
        dead = await row(backends.pool, poison.id)
        assert (dead.status, dead.error_code, dead.worker_losses) == (Status.FAILED, WORKER_LOST, 2)
        assert dead.attempt == 2 and exits[:2] == [-9, -9]  # two workers died on it, no third one ran it
        assert [(await row(backends.pool, t.id)).status for t in others] == [Status.SUCCEEDED] * len(others)
        assert [n["task_id"] for n in await dead_notices(backends.bus)] == [str(poison.id)]

        admin_key, _ = await auth.create_key(backends.pool, s.api_key_pepper, "ops", admin=True)
        env = {k: v for k, v in os.environ.items() if not k.startswith("TASKGATE_")} | {
            "TASKGATE_ADMIN_ADDRESS": f"127.0.0.1:{sched.port}",
            "TASKGATE_ADMIN_KEY": admin_key,
            "TASKGATE_STATE_DIR": str(tmp_path / "cli"),
        }
        cli = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "taskgate_client.cli", "admin", "dead-letters", "--json", env=env, cwd=tmp_path,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        )
        out, err = await asyncio.wait_for(cli.communicate(), 60)
        assert cli.returncode == 0, err.decode()
        [letter] = json.loads(out)["dead_letters"]
        assert (letter["task"]["id"], letter["task"]["error_code"], letter["reason"]) == (
            str(poison.id),
            WORKER_LOST,
            "worker lost",
        )
    finally:
        await sched.stop(0)


# ---- bystanders: a task that only shared a worker with a poison task is never blamed ----


async def registered(pool: asyncpg.Pool, *worker_ids: str) -> None:
    for worker_id in worker_ids:
        await registry.register(pool, registry.Registration(worker_id, ("wan-tiny",), 2, 0, "cpu", False))


async def test_a_loss_in_company_is_not_counted_and_the_task_runs_alone_after_it(
    backends: Backends, scheduler: Scheduler
) -> None:
    pool = backends.pool
    await registered(pool, "w1")
    poison, innocent = await insert_task(pool), await insert_task(pool)
    for task in (poison, innocent):
        assert (await store.queue(pool, task.id, actor="submit")).applied
    await claimed(pool, poison.id, "w1")
    await claimed(pool, innocent.id, "w1", lease=20.0)  # its lease runs out a scan later: the worker's count holds
    now = await db_now(pool)
    assert (await scheduler.run_once(now + timedelta(seconds=11)))[Action.RELEASE] == 1
    assert (await scheduler.run_once(now + timedelta(seconds=21)))[Action.RELEASE] == 1
    for task in (poison, innocent):
        lost = await row(pool, task.id)
        assert (lost.status, lost.worker_losses, lost.company_losses, lost.run_alone) == (Status.QUEUED, 0, 1, True)

    # alone from now on: its next loss is its own, counted; the one that reaches the cap fails it
    await registered(pool, "w2", "w3")
    await claimed(pool, poison.id, "w2")
    assert (await factories.claim(pool, poison.id, worker_id="w2")).verdict is Verdict.BUSY  # w2 takes nothing else
    await pool.execute("UPDATE worker SET last_heartbeat = now() - interval '1 minute' WHERE id = 'w2'")
    now = await db_now(pool)
    assert (await scheduler.run_once(now + timedelta(seconds=11)))[Action.RELEASE] == 1
    again = await row(pool, poison.id)
    assert (again.worker_losses, again.company_losses, again.attempt) == (1, 1, 2)
    await registered(pool, "w4")
    solo = await claimed(pool, innocent.id, "w3", lease=60.0)  # the oldest task to run alone, on an empty worker
    assert (solo.attempt, solo.worker_losses, solo.run_alone) == (2, 0, True)
    await claimed(pool, poison.id, "w4")
    now = await db_now(pool)
    assert (await scheduler.run_once(now + timedelta(seconds=11)))[Action.WORKER_LOST] == 1
    dead = await row(pool, poison.id)
    assert (dead.status, dead.error_code, dead.worker_losses, dead.company_losses) == (Status.FAILED, WORKER_LOST, 2, 1)


async def test_a_task_to_run_alone_is_reserved_by_a_busy_worker_and_taken_by_an_empty_one(backends: Backends) -> None:
    pool = backends.pool
    await registered(pool, "busy", "other", "empty")
    for worker_id in ("busy", "other"):
        running = await insert_task(pool)
        assert (await store.queue(pool, running.id, actor="submit")).applied
        await claimed(pool, running.id, worker_id)
    alone, normal = await insert_task(pool), await insert_task(pool)
    for task in (alone, normal):
        assert (await store.queue(pool, task.id, actor="submit")).applied
    await pool.execute("UPDATE task SET run_alone = true WHERE id = $1", alone.id)

    # a worker holding a task reserves it and is told to drain; it claims nothing else meanwhile
    got = await factories.claim(pool, normal.id, worker_id="busy")
    assert got.verdict is Verdict.ALONE and got.task is not None and got.task.id == alone.id
    assert (await row(pool, alone.id)).alone_for == "busy"
    # another busy worker passes it by (one worker drains for it, not all): it takes the fairest other task
    taken = await factories.claim(pool, alone.id, worker_id="other")
    assert taken.verdict is Verdict.CLAIMED and taken.task is not None and taken.task.id == normal.id
    # an empty worker takes it at once, reserved or not, and takes nothing else while it runs
    solo = await claimed(pool, alone.id, "empty")
    assert solo.run_alone and solo.alone_for is None and solo.attempt == 1
    later = await insert_task(pool)
    assert (await store.queue(pool, later.id, actor="submit")).applied
    assert (await factories.claim(pool, later.id, worker_id="empty")).verdict is Verdict.BUSY


async def test_a_drain_for_a_dead_worker_is_taken_over_and_a_drained_worker_claims_its_reservation(
    backends: Backends,
) -> None:
    pool = backends.pool
    await registered(pool, "gone", "drainer")
    held, alone = await insert_task(pool), await insert_task(pool)
    assert (await store.queue(pool, held.id, actor="submit")).applied
    mine = await claimed(pool, held.id, "drainer")
    assert (await store.queue(pool, alone.id, actor="submit")).applied
    await pool.execute("UPDATE task SET run_alone = true, alone_for = 'gone' WHERE id = $1", alone.id)
    await pool.execute("UPDATE worker SET last_heartbeat = now() - interval '1 minute' WHERE id = 'gone'")
    got = await factories.claim(pool, alone.id, worker_id="drainer")  # the reservation of a dead worker is open
    assert got.verdict is Verdict.ALONE and (await row(pool, alone.id)).alone_for == "drainer"
    assert (await store.release(pool, held.id, actor="worker", expected_attempt=mine.attempt)).applied  # drained
    assert (await claimed(pool, alone.id, "drainer")).run_alone


async def test_a_takeover_of_a_task_lost_in_company_runs_it_alone_and_does_not_count_it(backends: Backends) -> None:
    pool = backends.pool
    await registered(pool, "w1", "w2", "w3")
    first, second, other = await insert_task(pool), await insert_task(pool), await insert_task(pool)
    await claimed(pool, first.id, "w1", lease=-1.0)  # both leases already ran out: w1 is gone
    await claimed(pool, second.id, "w1", lease=-1.0)
    await claimed(pool, other.id, "w2")
    # a worker holding a task does not take one over (it would not run alone)
    assert (await factories.claim(pool, first.id, worker_id="w2", max_worker_losses=1)).verdict is Verdict.REFUSED
    # in company: the cap of 1 does not stop it
    taken = await factories.claimed(pool, first.id, worker_id="w3", max_worker_losses=1)
    assert (taken.attempt, taken.worker_losses, taken.company_losses, taken.run_alone) == (2, 0, 1, True)


def two_slot_poison_settings(settings: Settings) -> Settings:
    """Workers of two slots whose poison task dies half way through its run (its neighbour runs beside it by then),
    leases short enough that a death is found within a second, and the loss cap at 2."""
    return settings.model_copy(
        update={
            "models": {SLEEPY: sleepy.spec(0.6, default_steps=2, kill_on_prompt=POISON)},
            "default_model": SLEEPY,
            "worker_models": [SLEEPY],
            "worker_slots": 2,
            "lease_seconds": 1.0,
            "heartbeat_seconds": 0.25,
            "scan_interval_seconds": 0.2,
            "worker_cap_retry_seconds": 0.1,
            "max_worker_losses": 2,
        }
    )


async def test_a_task_sharing_a_worker_with_a_task_that_kills_it_is_never_blamed(
    settings: Settings, backends: Backends
) -> None:
    """Rounds of a poison task and an innocent one submitted together to one worker with two slots: today's claim ran
    the pair together again after the first death, and the innocent one ended FAILED WORKER_LOST with the poison."""
    s = two_slot_poison_settings(settings)
    sched = await scheduler_service.start(s, backends)
    rounds = 2
    try:
        async with worker_kept_running(s) as exits:
            for n in range(rounds):
                pair = []
                for prompt in (f"a harmless prompt {n}", f"{POISON} {n}"):
                    task = await insert_task(
                        backends.pool, model_id=SLEEPY, prompt=prompt, params={"num_inference_steps": 2}
                    )
                    assert (await store.queue(backends.pool, task.id, actor="submit")).applied
                    await backends.bus.js.publish(
                        busmod.task_subject(SLEEPY, task.priority), dispatch.encode(task),
                        headers={"Nats-Msg-Id": f"{task.id}.q0"},
                    )
                    pair.append(task)
                innocent, poison = pair

                async def finished(pair: list[TaskRow] = pair) -> bool:
                    return all([(await row(backends.pool, t.id)).status.terminal for t in pair])

                await wait_for(finished, within=60, every=0.1)
                done, dead = await row(backends.pool, innocent.id), await row(backends.pool, poison.id)
                # the first death was in company (not counted); then each ran alone: the innocent one finished, the
                # poison one killed two more workers, each death its own
                assert done.status is Status.SUCCEEDED, (n, done.status, done.error_code, done.attempt)
                assert (done.worker_losses, done.company_losses, done.attempt) == (0, 1, 2)
                assert (dead.status, dead.error_code) == (Status.FAILED, WORKER_LOST)
                assert (dead.worker_losses, dead.company_losses, dead.attempt) == (2, 1, 3)
            assert exits[: 3 * rounds] == [-9] * (3 * rounds)
    finally:
        await sched.stop(0)


async def test_a_worker_holding_a_task_drains_to_run_a_task_alone_and_takes_nothing_beside_it(
    settings: Settings, backends: Backends, workers: WorkerFactory
) -> None:
    s = sleepy_settings(settings, sleep=1.0).model_copy(update={"worker_slots": 2, "worker_cap_retry_seconds": 0.1})
    await workers(s)
    first = await submit(backends, params=params(steps=2, seed=1))

    async def started() -> bool:
        return (await row(backends.pool, first.id)).started_at is not None

    await wait_for(started, within=20)
    alone = await insert_task(backends.pool, model_id=SLEEP_MODEL, params=params(steps=2, seed=2))
    assert (await store.queue(backends.pool, alone.id, actor="submit")).applied
    await backends.pool.execute("UPDATE task SET run_alone = true WHERE id = $1", alone.id)  # as after a lost worker
    await publish(backends, alone, f"{alone.id}.q0")
    after = await submit(backends, params=params(steps=2, seed=3))  # an ordinary task, queued behind it
    tasks = (first, alone, after)

    async def done() -> bool:
        return all([(await row(backends.pool, t.id)).status is Status.SUCCEEDED for t in tasks])

    await wait_for(done, within=30)
    ran = [await row(backends.pool, t.id) for t in tasks]
    assert [(r.worker_id, r.attempt) for r in ran] == [(ran[0].worker_id, 1)] * 3
    spans = [(r.started_at, r.finished_at) for r in ran]
    assert all(a is not None and b is not None for a, b in spans)
    # the worker's free slot waited for the first task to end (it drained), then ran the task alone, then the next
    assert spans[0][1] <= spans[1][0] and spans[1][1] <= spans[2][0], spans  # type: ignore[operator]


async def test_with_several_workers_only_the_task_that_kills_them_is_blamed(
    settings: Settings, backends: Backends
) -> None:
    """Two workers of two slots, four tasks at once (one of them poison): every slot is taken, the poison task's
    neighbour dies with it in company, and both run alone after, on the restarted worker or on the other once it
    drains."""
    s = two_slot_poison_settings(settings)
    sched = await scheduler_service.start(s, backends)
    try:
        async with worker_kept_running(s) as exits, worker_kept_running(s) as other_exits:
            tasks = []
            for n in range(4):
                prompt = f"{POISON} {n}" if n == 1 else f"a harmless prompt {n}"
                tasks.append(await submit(backends, model=SLEEPY, prompt=prompt, params={"num_inference_steps": 2}))

            async def finished() -> bool:
                return all([(await row(backends.pool, t.id)).status.terminal for t in tasks])

            await wait_for(finished, within=90, every=0.1)
            rows = [await row(backends.pool, t.id) for t in tasks]
            poison, innocents = rows[1], rows[:1] + rows[2:]
            assert [(r.status, r.worker_losses) for r in innocents] == [(Status.SUCCEEDED, 0)] * 3, innocents
            assert (poison.status, poison.error_code, poison.worker_losses) == (Status.FAILED, WORKER_LOST, 2)
            assert sum(r.company_losses for r in rows) <= 2  # one death in company at most: the poison's first
            assert sorted(exits + other_exits)[:3] == [-9, -9, -9]
    finally:
        await sched.stop(0)
