"""A running task's progress, live: each step from the worker to the WatchTask streams over core NATS
(taskgate.wire.progress), while PostgreSQL keeps the newest only every progress_interval_seconds."""

from __future__ import annotations

import asyncio
from typing import Any

import grpc

from taskgate import bus as busmod
from taskgate.config import Settings
from taskgate.runtime import Backends
from taskgate.wire import progress as progress_wire
from taskgate_api.v1 import events_pb2, task_pb2
from tests.support.factories import sleepy_settings, submit
from tests.support.harness import bearer, wait_for
from tests.support.notifier import events_stub, fast

STEPS = 40
SECONDS = 4.0  # the run: a step every 0.1 s
INTERVAL = 1.0  # the coarse writes: one progress row a second at most
TERMINAL = {task_pb2.TASK_STATUS_SUCCEEDED, task_pb2.TASK_STATUS_FAILED, task_pb2.TASK_STATUS_CANCELED}


async def test_each_step_reaches_the_stream_while_the_table_gets_the_coarse_writes_only(
    backends: Backends, settings: Settings, notifier_factory: Any, workers: Any, api_key: str
) -> None:
    notifier = await notifier_factory(fast(settings))
    await workers(sleepy_settings(settings, sleep=SECONDS), progress_interval_seconds=INTERVAL)
    task = await submit(backends, params={"num_inference_steps": STEPS})
    live: list[task_pb2.TaskProgress] = []
    events: list[task_pb2.TaskEvent] = []
    async with events_stub(notifier) as stub:
        call = stub.WatchTask(events_pb2.WatchTaskRequest(task_id=str(task.id)), metadata=bearer(api_key))
        async with asyncio.timeout(60):
            while (item := await call.read()) is not grpc.aio.EOF:
                if item.HasField("progress"):
                    live.append(item.progress)
                elif item.HasField("event"):
                    events.append(item.event)
                    if item.event.to_status in TERMINAL:
                        break
    assert events[-1].to_status == task_pb2.TASK_STATUS_SUCCEEDED
    processing = next(e for e in events if e.to_status == task_pb2.TASK_STATUS_PROCESSING)
    steps = [p.step for p in live]
    # per step: every one after the stream saw the task start (a step missed at the seam is superseded by the next)
    assert len(steps) >= STEPS // 2, steps
    assert steps == sorted(set(steps)) and all(p.total_steps == STEPS and p.attempt == 1 for p in live), live
    assert all(p.task_id == str(task.id) and p.progress == min(99, p.step * 100 // STEPS) for p in live)
    # the table: the coarse writes only, each one a `progress` event with its history row (and its webhook)
    rows = await backends.pool.fetch(
        "SELECT version, at FROM task_event WHERE task_id = $1 AND reason = 'progress' ORDER BY version", task.id
    )
    began, ended = processing.at.ToDatetime(), events[-1].at.ToDatetime()
    assert len(rows) <= (ended - began).total_seconds() / INTERVAL + 1, (len(rows), len(steps))
    assert len(rows) < len(steps) / 4
    progress_events = [e for e in events if e.to_status == task_pb2.TASK_STATUS_PROCESSING and e.reason == "progress"]
    assert len(progress_events) == len(rows)  # the stream got each coarse write as an event too, once
    version = await backends.pool.fetchval("SELECT version FROM task WHERE id = $1", task.id)
    assert version == events[-1].version


async def test_a_workers_steps_go_as_one_message_per_tenant_per_tick(
    backends: Backends, settings: Settings, notifier_factory: Any, workers: Any, api_key: str
) -> None:
    """Four slots stepping every 0.1 s: their steps go coalesced (the newest of each task per tick, one message for the
    tenant), not a message per step; a stream of one of them still gets its steps."""
    slots, steps, seconds, tick = 4, 20, 2.0, 0.25
    notifier = await notifier_factory(fast(settings))
    messages: list[tuple[str, list[task_pb2.TaskProgress]]] = []

    async def heard(msg: Any) -> None:
        items = progress_wire.decode(msg.data)
        assert items is not None
        messages.append((msg.subject, items))

    sub = await backends.bus.nc.subscribe(busmod.PROGRESS_SUBJECTS, cb=heard)
    await workers(sleepy_settings(settings, sleep=seconds), worker_slots=slots, live_progress_tick_seconds=tick)
    tasks = [await submit(backends, params={"num_inference_steps": steps}) for _ in range(slots)]
    live: list[task_pb2.TaskProgress] = []
    async with events_stub(notifier) as stub:
        call = stub.WatchTask(events_pb2.WatchTaskRequest(task_id=str(tasks[0].id)), metadata=bearer(api_key))
        async with asyncio.timeout(60):
            while (item := await call.read()) is not grpc.aio.EOF:
                if item.HasField("progress"):
                    live.append(item.progress)
                elif item.HasField("event") and item.event.to_status in TERMINAL:
                    break
        # every task ended: its steps are all out
        await wait_for(lambda: _all_ended(backends, [t.id for t in tasks]), 30)
    await sub.unsubscribe()
    ids = {str(t.id) for t in tasks}
    items = [item for _, group in messages for item in group if item.task_id in ids]
    assert {subject for subject, _ in messages} == {busmod.progress_subject(tasks[0].user_id)}
    assert {item.task_id for item in items} == ids
    # 80 steps in about 2 s: at most one message per tick over the span they were sent in, besides the first (at once)
    # and each run's last step (handed over when its device phase ends)
    stamps = [item.at.ToNanoseconds() / 1e9 for item in items]
    assert len(messages) <= (max(stamps) - min(stamps)) / tick + 1 + slots, [len(group) for _, group in messages]
    assert max(len(group) for _, group in messages) >= 2
    assert len(items) >= len(messages) * 2
    for task_id in ids:  # each task's steps in order, its last one among them
        mine = [item.step for item in items if item.task_id == task_id]
        assert mine == sorted(set(mine)) and mine[-1] == steps, mine
    assert live and all(p.task_id == str(tasks[0].id) for p in live)


async def _all_ended(backends: Backends, ids: list[int]) -> bool:
    return bool(await backends.pool.fetchval(
        "SELECT bool_and(status = 'SUCCEEDED') FROM task WHERE id = ANY($1::bigint[])", ids))
