"""The worker running the tiny real Wan pipeline (built offline once per module) end to end."""

from __future__ import annotations

import os
import time
from collections.abc import AsyncIterator
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest

from services.worker import service as worker_service
from services.worker.inference import decode_mp4_info
from services.worker.service import WorkerHandle
from taskgate import bus as busmod
from taskgate import results, store
from taskgate.config import ModelSpec, Settings
from taskgate.runtime import Backends
from taskgate.states import Priority, Status
from taskgate.store import CancelMode
from taskgate.wire import cancel
from taskgate_local.tinymodel import build_tiny_pipeline
from tests.test_worker import events, is_status, params, read_result, report_for, submit, wait_consumer_empty, wait_task

MODEL = "wan-tiny"


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny random-weight Wan pipeline, saved once for this module."""
    return build_tiny_pipeline(tmp_path_factory.mktemp("models") / MODEL)


@pytest.fixture
async def wan_worker(settings: Settings, tiny_model: Path) -> AsyncIterator[WorkerHandle]:
    """A worker serving only wan-tiny from the module's folder, writing progress at every 10%."""
    models = dict(settings.models)
    models[MODEL] = ModelSpec(path=tiny_model)
    s = settings.model_copy(update={"models": models, "worker_models": [MODEL], "worker_slots": 1, "progress_interval_seconds": 0.0})
    handle = await worker_service.start(s)
    try:
        yield handle
    finally:
        await handle.stop(grace=0)


async def test_tiny_pipeline_task_yields_the_requested_video_and_same_seed_same_bytes(backends: Backends, wan_worker: WorkerHandle) -> None:
    first = await submit(backends, model=MODEL, params=params(steps=6, seed=7))
    again = await submit(backends, model=MODEL, params=params(steps=6, seed=7))
    other = await submit(backends, model=MODEL, params=params(steps=6, seed=8))
    rows = [await wait_task(backends, t.id, is_status(Status.SUCCEEDED), within=60) for t in (first, again, other)]
    for row in rows:
        assert row.result_content_type == "video/mp4" and row.result_uri is not None
        data = await read_result(wan_worker.worker.settings, backends, row.result_uri)
        assert len(data) == row.result_size
        assert decode_mp4_info(data) == (9, 32, 32)  # frames, width, height as requested
    assert rows[0].result_sha256 == rows[1].result_sha256 != rows[2].result_sha256

    progress = [e["progress"] for e in await events(backends, first.id) if e["to_status"] == "PROCESSING"]
    # writes are coalesced (only the newest value is sent), so a slow database sees fewer of them: at least one
    assert progress[0] == 0 and progress == sorted(progress) and len(set(progress)) >= 2
    assert wan_worker.worker.status().device == "cpu"
    await wait_consumer_empty(backends, MODEL, Priority.NORMAL)


async def test_hard_cancel_stops_the_pipeline_within_one_step(backends: Backends, wan_worker: WorkerHandle) -> None:
    total = 1000
    task = await submit(backends, model=MODEL, params=params(steps=total, seed=3))
    await wait_task(backends, task.id, lambda r: r.status is Status.PROCESSING and r.progress > 0, within=60)
    assert (await store.cancel(backends.pool, task.id, mode=CancelMode.HARD, actor="submit")).applied
    assert await cancel.send(backends.bus, task.id, hard=True, reason="test")
    started = time.monotonic()
    report = await wan_worker.worker.wait_for(report_for(task.id), within=30)
    assert report.outcome == "canceled" and report.steps_at_abort is not None
    assert report.steps_done <= report.steps_at_abort + 1 and report.steps_done < total
    assert time.monotonic() - started < 10  # a step or two, not the 1000-step run
    assert wan_worker.worker.status().free_slots == 1
    row = await store.get_task(backends.pool, task.id)
    assert row is not None and row.status is Status.CANCELED and row.result_uri is None
    with pytest.raises(results.ResultNotFound):
        await read_result(wan_worker.worker.settings, backends, f"nats-os://{busmod.RESULTS_BUCKET}/{task.id}-a1.mp4")
    await wait_consumer_empty(backends, MODEL, Priority.NORMAL)
