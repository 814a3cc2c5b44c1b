"""Deleted means deleted: a task purged by retention (or an operator: the same statement), or whose output expired,
is forgotten by every submit replica's terminal-task cache, which had answered GetTask from memory for as long as
the entry stayed in its LRU."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from datetime import timedelta
from pathlib import Path

import grpc
import pytest

from services.scheduler.retention import RetentionScan
from services.scheduler.scans import Action, ScanContext
from services.submit.cache import TerminalCache
from services.submit.service import SubmitHandle
from services.submit.service import start as start_submit
from taskgate import store
from taskgate.config import Settings
from taskgate.results import FolderResults
from taskgate.runtime import Backends
from taskgate_api.v1 import gateway_pb2, gateway_pb2_grpc
from tests.support import factories
from tests.support.factories import Claim, insert_task, moved
from tests.support.harness import wait_for
from tests.support.queries import db_now

DAY = 86400.0


@pytest.fixture
def settings(settings: Settings, tmp_path: Path) -> Settings:
    return settings.model_copy(update={
        "result_store": "fs", "result_dir": tmp_path / "results", "retain_tasks_seconds": 30 * DAY,
        "retain_results_seconds": 7 * DAY, "retain_events_seconds": 0.0, "retain_reusable_seconds": 0.0,
    })


@pytest.fixture
async def replicas(settings: Settings, backends: Backends) -> AsyncIterator[list[SubmitHandle]]:
    handles = [await start_submit(settings, backends) for _ in range(2)]
    try:
        await asyncio.gather(*(asyncio.wait_for(h.gateway.revocations.connected.wait(), 10) for h in handles))
        yield handles
    finally:
        for handle in handles:
            await handle.stop(0)


async def test_purged_tasks_and_expired_outputs_are_forgotten_by_every_replica(
    settings: Settings, backends: Backends, replicas: list[SubmitHandle]
) -> None:
    outputs = FolderResults(settings.result_dir or Path())
    task = await insert_task(backends.pool)
    stored = await outputs.put("a.mp4", b"video", "video/mp4")
    for change in (
        store.Queue(),
        Claim("w1", 10.0),
        store.Succeed(store.ResultRef(stored.uri, "video/mp4", 5, "ab" * 32)),
    ):
        assert (await moved(backends.pool, task.id, change)).applied
    md = await factories.key_for(backends)
    channels = [grpc.aio.insecure_channel(f"127.0.0.1:{h.port}") for h in replicas]
    stubs = [gateway_pb2_grpc.TaskGatewayStub(ch) for ch in channels]
    request = gateway_pb2.GetTaskRequest(task_id=str(task.id))
    try:
        for stub in stubs:  # each replica reads the finished task once: it is in both caches now
            got = await stub.GetTask(request, metadata=md, timeout=10)
            assert got.task.result.uri and not got.task.result.HasField("deleted_at")
        scan = RetentionScan(ScanContext(settings, backends.pool, backends.bus))
        t0 = await db_now(backends.pool)

        expired = await scan.run(t0 + timedelta(days=8))  # the output's retention ends; the task stays
        assert expired.actions[Action.PURGE_RESULT] == 1

        async def output_gone_everywhere() -> bool:
            answers = [await stub.GetTask(request, metadata=md, timeout=10) for stub in stubs]
            return all(a.task.result.HasField("deleted_at") for a in answers)

        await wait_for(output_gone_everywhere, within=10)

        purged = await scan.run(t0 + timedelta(days=31))  # the task's retention ends
        assert purged.actions[Action.PURGE_TASK] == 1

        async def gone_everywhere() -> bool:
            codes = []
            for stub in stubs:
                try:
                    await stub.GetTask(request, metadata=md, timeout=10)
                    codes.append(grpc.StatusCode.OK)
                except grpc.aio.AioRpcError as exc:
                    codes.append(exc.code())
            return codes == [grpc.StatusCode.NOT_FOUND] * len(stubs)

        await wait_for(gone_everywhere, within=10)
    finally:
        for ch in channels:
            await ch.close()


async def test_the_cache_forgets_by_age_and_on_a_missed_notification(backends: Backends) -> None:
    now = [0.0]
    cache = TerminalCache(10, max_age=60.0, clock=lambda: now[0])
    rows = []
    for i in range(3):
        task = await insert_task(backends.pool, prompt=f"p{i}")
        out = await moved(backends.pool, task.id, store.Cancel(store.CancelMode.SOFT))
        assert out.task is not None
        rows.append(out.task)
        cache.put(out.task)
    cache.forget(str(rows[1].id))
    assert cache.get(rows[1].id) is None and cache.get(rows[0].id) is rows[0]
    now[0] = 61.0
    assert cache.get(rows[0].id) is None  # older than its age limit
    cache.put(rows[0])
    cache.forget(None)  # the listen connection was (re)made: anything may have been missed
    assert len(cache) == 0
