"""Reads of the database and the bus that tests check against, and waits on them."""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime
from typing import Any

import asyncpg
from nats.js.api import RawStreamMsg

from services.worker.engine import RunReport
from taskgate import bus as busmod
from taskgate import results, store
from taskgate.config import CommonSettings
from taskgate.model import TaskRow
from taskgate.runtime import Backends
from taskgate.states import Status
from taskgate_api.v1 import task_pb2
from tests.support.harness import wait_for


async def wait_task(
    backends: Backends, task_id: int, check: Callable[[TaskRow], bool], within: float = 10.0
) -> TaskRow:
    """The task's row once `check` holds (polled by wait_for); the timeout names the last state seen."""
    seen: list[TaskRow] = []

    async def holds() -> bool:
        seen[:] = [await row(backends.pool, task_id)]
        return check(seen[0])

    try:
        await wait_for(holds, within, every=0.02)
    except TimeoutError:
        raise AssertionError(
            f"task {task_id} never matched; last state {seen[0].status} attempt {seen[0].attempt}"
        ) from None
    return seen[0]


def is_status(*statuses: Status) -> Callable[[TaskRow], bool]:
    return lambda row: row.status in statuses


async def events(backends: Backends, task_id: int) -> list[Any]:
    return list(await backends.pool.fetch("SELECT * FROM task_event WHERE task_id = $1 ORDER BY version", task_id))


async def consumer_counts(backends: Backends, model: str, priority: int) -> tuple[int, int]:
    info = await backends.bus.js.consumer_info(busmod.TASKS_STREAM, busmod.consumer_name(model, priority))
    return info.num_pending or 0, info.num_ack_pending or 0


async def wait_consumer_empty(backends: Backends, model: str, priority: int, within: float = 5.0) -> None:
    """Until the model's consumer at `priority` holds no message, pending or awaiting its ack."""

    async def empty() -> bool:
        return await consumer_counts(backends, model, priority) == (0, 0)

    await wait_for(empty, within, every=0.02)


def report_for(task_id: int, outcome: str | None = None) -> Callable[[RunReport], bool]:
    return lambda r: r.task_id == task_id and (outcome is None or r.outcome == outcome)


async def read_result(settings: CommonSettings, backends: Backends, uri: str) -> bytes:
    return b"".join([chunk async for chunk in results.result_store(settings, backends.bus).read(uri)])


async def db_now(pool: asyncpg.Pool) -> datetime:
    return await pool.fetchval("SELECT now()")


async def row(pool: asyncpg.Pool, task_id: int) -> TaskRow:
    task = await store.get_task(pool, task_id)
    assert task is not None
    return task


async def dispatches(bus: busmod.Bus) -> list[tuple[str, str, task_pb2.TaskDispatch]]:
    """Every message on the TASKS stream: (subject, Nats-Msg-Id, payload), read without consuming."""
    info = await bus.js.stream_info(busmod.TASKS_STREAM)
    out = []
    for seq in range(info.state.first_seq, info.state.last_seq + 1):
        if info.state.messages == 0:
            break
        msg: RawStreamMsg = await bus.js.get_msg(busmod.TASKS_STREAM, seq)
        out.append(
            (
                msg.subject or "",
                (msg.headers or {}).get("Nats-Msg-Id", ""),
                task_pb2.TaskDispatch.FromString(msg.data or b""),
            )
        )
    return out
