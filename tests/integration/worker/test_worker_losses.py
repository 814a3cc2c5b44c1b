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
from taskgate.config import ModelSpec, Settings
from taskgate.model import TaskRow
from taskgate.runtime import Backends
from taskgate.states import Status
from taskgate.store.workers import Verdict
from taskgate.wire import dispatch
from tests.support import factories
from tests.support.factories import all_settings, insert_task
from tests.support.harness import ROOT, settings_env, wait_for
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
    assert (failed.status, failed.error_code, failed.worker_losses, failed.attempt) == (Status.FAILED, WORKER_LOST, 2, 2)
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
    await pool.execute("UPDATE task SET processed_seconds = $2 WHERE id = $1", task.id, s.processing_timeout_seconds - 50)
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
            "models": {SLEEPY: ModelSpec(kind="sleep", sleep_seconds=0.2, default_steps=2, kill_on_prompt=POISON)},
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
        assert (letter["task"]["id"], letter["task"]["error_code"], letter["reason"]) == (str(poison.id), WORKER_LOST, "worker lost")
    finally:
        await sched.stop(0)
