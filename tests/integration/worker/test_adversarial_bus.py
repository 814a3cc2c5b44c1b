"""Hostile messages on the task subjects: the worker drops them, keeps its slot free, and still runs real work."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest

from services.worker import service as worker_service
from services.worker.service import WorkerHandle
from taskgate import bus as busmod
from taskgate import store
from taskgate.config import ModelSpec, Settings
from taskgate.model import TaskRow
from taskgate.runtime import Backends
from taskgate.states import Priority, Status
from taskgate.store import TaskError
from taskgate_api.v1 import task_pb2
from tests.support.factories import claimed, insert_task
from tests.support.harness import wait_for

SLEEPY = "sleepy"
SUBJECT = busmod.task_subject(SLEEPY, Priority.NORMAL)


@pytest.fixture
def worker_settings(settings: Settings) -> Settings:
    """One slot (so a stuck slot shows at once), the sleep model only, short leases and redelivery."""
    return settings.model_copy(
        update={
            "models": {**settings.models, SLEEPY: ModelSpec(kind="sleep")},
            "worker_models": [SLEEPY],
            "worker_slots": 1,
            "lease_seconds": 2.0,
            "heartbeat_seconds": 0.5,
            "drain_grace_seconds": 0.0,
            "worker_cap_retry_seconds": 0.1,
        }
    )


@pytest.fixture
async def worker(worker_settings: Settings, backends: Backends) -> AsyncIterator[WorkerHandle]:
    handle = await worker_service.start(worker_settings)
    try:
        yield handle
    finally:
        await handle.stop(grace=0)


def dispatch(task_id: str, model: str = SLEEPY) -> bytes:
    return task_pb2.TaskDispatch(task_id=task_id, model_id=model, priority=task_pb2.PRIORITY_NORMAL).SerializeToString()


async def publish(backends: Backends, data: bytes, msg_id: str, subject: str = SUBJECT) -> None:
    await backends.bus.js.publish(subject, data, headers={"Nats-Msg-Id": msg_id})


async def consumer_drained(backends: Backends) -> bool:
    info = await backends.bus.js.consumer_info(busmod.TASKS_STREAM, busmod.consumer_name(SLEEPY, Priority.NORMAL))
    return (info.num_pending or 0, info.num_ack_pending or 0) == (0, 0)


async def run_normal_task(backends: Backends, prompt: str) -> TaskRow:
    """A well-formed task, dispatched the way submit does; returns its finished row."""
    task = await insert_task(backends.pool, model_id=SLEEPY, prompt=prompt)
    await publish(backends, dispatch(str(task.id)), f"{task.id}.q0")
    await store.queue(backends.pool, task.id, actor="submit")

    async def done() -> bool:
        row = await store.get_task(backends.pool, task.id)
        return row is not None and row.status.terminal

    await wait_for(done, 10)
    row = await store.get_task(backends.pool, task.id)
    assert row is not None
    return row


POISON: dict[str, bytes] = {
    "empty body": b"",
    "random bytes": bytes(range(256)) * 4,
    "not protobuf": b"\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff",
    "json instead of protobuf": b'{"task_id": "1"}',
    "empty task id": dispatch(""),
    "letters": dispatch("abc"),
    "negative id": dispatch("-1"),
    "zero": dispatch("0"),
    "spaces": dispatch(" 12 "),
    "non-ascii digits": dispatch("\u0661\u0662\u0663"),
    "beyond int64": dispatch("99999999999999999999999"),
    "unknown task": dispatch("385000000000000001"),
    "huge message": dispatch("1") + b"\x42" + b"\x00" * 600_000,
}


@pytest.mark.parametrize("kind", list(POISON))
async def test_poison_message_is_dropped_and_the_slot_stays_free(
    backends: Backends, worker: WorkerHandle, kind: str
) -> None:
    await publish(backends, POISON[kind], f"poison-{kind}")
    await wait_for(lambda: consumer_drained(backends), 10)
    row = await run_normal_task(backends, f"after {kind}")
    assert row.status is Status.SUCCEEDED and row.attempt == 1
    await wait_for(lambda: consumer_drained(backends), 5)


async def test_message_naming_a_task_of_another_model_does_not_claim_it(
    backends: Backends, worker: WorkerHandle
) -> None:
    # A wan-tiny task (this worker does not serve that model) announced on the sleepy subject.
    foreign = await insert_task(backends.pool, model_id="wan-tiny")
    await store.queue(backends.pool, foreign.id, actor="submit")
    await publish(backends, dispatch(str(foreign.id), "wan-tiny"), f"{foreign.id}.stray")
    await wait_for(lambda: consumer_drained(backends), 10)
    row = await run_normal_task(backends, "after a stray message")
    assert row.status is Status.SUCCEEDED
    untouched = await store.get_task(backends.pool, foreign.id)
    assert untouched is not None and untouched.status is Status.QUEUED and untouched.attempt == 0, untouched


async def test_replayed_messages_of_finished_tasks_change_nothing(backends: Backends, worker: WorkerHandle) -> None:
    done = await run_normal_task(backends, "finished once")
    assert done.status is Status.SUCCEEDED
    failed = await insert_task(backends.pool, model_id=SLEEPY, prompt="failed once")
    assert (await store.queue(backends.pool, failed.id, actor="test")).applied
    await claimed(backends.pool, failed.id, worker_id="w-old", lease_seconds=30.0)
    boom = TaskError("BOOM", "failed for good")
    assert (await store.fail(backends.pool, failed.id, error=boom, actor="test", reason="failed for good")).applied
    failed_row = await store.get_task(backends.pool, failed.id)
    assert failed_row is not None
    before = {t.id: (t.version, t.attempt, t.status) for t in (done, failed_row)}
    stream_before = (await backends.bus.js.stream_info(busmod.TASKS_STREAM)).state.messages

    # The very same message again (same id, inside the dedupe window): JetStream drops it.
    await publish(backends, dispatch(str(done.id)), f"{done.id}.q0")
    assert (await backends.bus.js.stream_info(busmod.TASKS_STREAM)).state.messages == stream_before
    # Replays under new message ids, many times over: the worker refuses every claim and acks.
    for i in range(20):
        await publish(backends, dispatch(str(done.id)), f"{done.id}.replay{i}")
        await publish(backends, dispatch(str(failed.id)), f"{failed.id}.replay{i}")
    await wait_for(lambda: consumer_drained(backends), 30)  # acked as refused, not left to ack-wait redelivery
    for task_id, state in before.items():
        row = await store.get_task(backends.pool, task_id)
        assert row is not None and (row.version, row.attempt, row.status) == state
    after = await run_normal_task(backends, "after replays")
    assert after.status is Status.SUCCEEDED and after.attempt == 1


async def test_a_flood_of_poison_does_not_starve_a_real_task(backends: Backends, worker: WorkerHandle) -> None:
    publishes: list[Any] = []
    for i in range(300):
        publishes.append(publish(backends, POISON["unknown task"] if i % 2 else POISON["random bytes"], f"flood-{i}"))
    await asyncio.gather(*publishes)
    row = await run_normal_task(backends, "behind the flood")
    assert row.status is Status.SUCCEEDED
    await wait_for(lambda: consumer_drained(backends), 15)


async def test_a_burst_never_runs_more_tasks_than_the_worker_has_slots(
    backends: Backends, worker_settings: Settings
) -> None:
    slow = worker_settings.model_copy(
        update={"models": {**worker_settings.models, SLEEPY: ModelSpec(kind="sleep", sleep_seconds=0.2)}}
    )
    handle = await worker_service.start(slow)
    try:
        ids = []
        for i in range(20):
            task = await insert_task(
                backends.pool, model_id=SLEEPY, prompt=f"burst {i}", params={"num_inference_steps": 2, "seed": i}
            )
            await publish(backends, dispatch(str(task.id)), f"{task.id}.q0")
            ids.append(task.id)
        peak = 0

        async def finished() -> bool:
            nonlocal peak
            running = await backends.pool.fetchval("SELECT count(*) FROM task WHERE status = 'PROCESSING'")
            peak = max(peak, int(running))
            done = await backends.pool.fetchval("SELECT count(*) FROM task WHERE status = 'SUCCEEDED'")
            return bool(done == len(ids))

        await wait_for(finished, 30, every=0.005)
    finally:
        await handle.stop(grace=0)
    # One slot; it takes its next task while the previous output is stored, so two rows may overlap, never more.
    assert peak <= 2, f"{peak} tasks PROCESSING at once on a 1-slot worker"


async def test_the_worker_claims_again_after_the_database_drops_its_connections(
    backends: Backends, worker: WorkerHandle
) -> None:
    before = await run_normal_task(backends, "before the connections drop")
    assert before.status is Status.SUCCEEDED
    # What a PostgreSQL restart or failover does to every pooled connection of the worker.
    dropped = await backends.pool.fetchval(
        "SELECT count(*) FROM (SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
        " WHERE datname = current_database() AND pid <> pg_backend_pid() AND application_name = '') AS t"
    )
    assert dropped >= 1
    await backends.pool.expire_connections()  # ours went too; the test's own pool reconnects
    after = await run_normal_task(backends, "after the connections dropped")
    assert after.status is Status.SUCCEEDED and after.attempt == 1
