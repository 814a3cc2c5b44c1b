"""The worker running every family's tiny real pipeline (Wan, CogVideoX, LTX-Video, HunyuanVideo; built offline) end to
end."""

from __future__ import annotations

import os
import time
from collections.abc import AsyncIterator
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.worker import runner as runmod
from services.worker import service as worker_service
from services.worker.encoding import decode_mp4_info
from services.worker.engine import TestSignals
from services.worker.service import WorkerHandle
from taskgate import store
from taskgate.config import ModelSpec, Settings
from taskgate.families import TEXT_TO_VIDEO
from taskgate.runtime import Backends
from taskgate.states import Priority, Status
from taskgate.store import CancelMode
from taskgate.wire import cancel
from taskgate_local.tinymodel import build_tiny_pipeline, tiny_models, tiny_spec
from tests.support.factories import params, submit
from tests.support.harness import stored_objects
from tests.support.queries import events, is_status, read_result, report_for, wait_consumer_empty, wait_task

TINY_MODELS = tiny_models(TEXT_TO_VIDEO)  # image-to-video runs through the services in test_image_to_video


@pytest.fixture(scope="module", params=sorted(TINY_MODELS))
def model(request: pytest.FixtureRequest) -> str:
    """Each tiny model in turn: every test using it runs once per family."""
    return str(request.param)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory, model: str) -> Path:
    """The family's tiny random-weight pipeline, saved once for this module."""
    return build_tiny_pipeline(tmp_path_factory.mktemp("models") / model, pipeline=TINY_MODELS[model])


def worker_settings(settings: Settings, model: str, spec: ModelSpec) -> Settings:
    """Settings of a one-slot worker serving only `model`, writing progress at every 10%."""
    models = {**settings.models, model: spec}
    return settings.model_copy(
        update={"models": models, "worker_models": [model], "worker_slots": 1, "progress_interval_seconds": 0.0}
    )


@pytest.fixture
async def family_worker(settings: Settings, tiny_model: Path, model: str) -> AsyncIterator[WorkerHandle]:
    """A worker serving only the family's tiny model from the module's folder."""
    handle = await worker_service.start(
        worker_settings(settings, model, tiny_spec(TINY_MODELS[model], tiny_model)), signals=TestSignals().arm()
    )
    try:
        yield handle
    finally:
        await handle.stop(grace=0)


async def test_tiny_pipeline_task_yields_the_requested_video_and_same_seed_same_bytes(
    backends: Backends, family_worker: WorkerHandle, model: str
) -> None:
    first = await submit(backends, model=model, params=params(steps=6, seed=7))
    again = await submit(backends, model=model, params=params(steps=6, seed=7))
    other = await submit(backends, model=model, params=params(steps=6, seed=8))
    rows = [await wait_task(backends, t.id, is_status(Status.SUCCEEDED), within=60) for t in (first, again, other)]
    for row in rows:
        assert row.result_content_type == "video/mp4" and row.result_uri is not None
        data = await read_result(family_worker.worker.settings, backends, row.result_uri)
        assert len(data) == row.result_size
        assert decode_mp4_info(data) == (9, 32, 32)  # frames, width, height as requested
    assert rows[0].result_sha256 == rows[1].result_sha256 != rows[2].result_sha256

    progress = [e["progress"] for e in await events(backends, first.id) if e["to_status"] == "PROCESSING"]
    # writes are coalesced (only the newest value is sent), so a slow database sees fewer of them: at least one
    assert progress[0] == 0 and progress == sorted(progress) and len(set(progress)) >= 2
    assert family_worker.worker.status().device == "cpu"
    await wait_consumer_empty(backends, model, Priority.NORMAL)


async def test_hard_cancel_stops_the_pipeline_within_one_step(
    backends: Backends, family_worker: WorkerHandle, model: str
) -> None:
    total = 1000
    task = await submit(backends, model=model, params=params(steps=total, seed=3))
    await wait_task(backends, task.id, lambda r: r.status is Status.PROCESSING and r.progress > 0, within=60)
    assert (await store.cancel(backends.pool, task.id, mode=CancelMode.HARD, actor="submit")).applied
    assert await cancel.send(backends.bus, task.id, hard=True, reason="test")
    started = time.monotonic()
    report = await family_worker.worker.signals.reported.wait_for(report_for(task.id), within=30)
    assert report.outcome == "canceled" and report.steps_at_abort is not None
    assert report.steps_done <= report.steps_at_abort + 1 and report.steps_done < total
    assert time.monotonic() - started < 10  # a step or two, not the 1000-step run
    assert family_worker.worker.status().free_slots == 1
    row = await store.get_task(backends.pool, task.id)
    assert row is not None and row.status is Status.CANCELED and row.result_uri is None
    assert await stored_objects(backends.bus, f"{task.id}-") == []  # a hard cancel stores nothing
    await wait_consumer_empty(backends, model, Priority.NORMAL)


@pytest.mark.slow
async def test_a_compiled_model_is_warmed_before_the_worker_serves(settings: Settings, tmp_path: Path) -> None:
    folder = build_tiny_pipeline(tmp_path / "wan-tiny")
    # 'eager' traces like inductor without minutes of kernel generation on a CPU.
    spec = tiny_spec("WanPipeline", folder, torch_compile="blocks", compile_backend="eager", vae_tiling=True)
    handle = await worker_service.start(worker_settings(settings, "wan-compiled", spec))
    try:
        pipeline = handle.worker.attempts.runners[("wan-compiled", "cpu")].pipeline  # type: ignore[union-attr]
        assert pipeline.warmup_seconds is not None and pipeline.warmup_seconds > 0
        assert all(
            getattr(block, "_compiled_call_impl", None) is not None for block in pipeline.pipe.transformer.blocks
        )
        async with grpc.aio.insecure_channel(f"127.0.0.1:{handle.port}") as channel:
            reply = await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=worker_service.SERVICE_NAME)
            )
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
    finally:
        await handle.stop(grace=0)


@pytest.mark.parametrize(
    ("changes", "why"),
    [
        ({"size_multiple": 8, "max_width": 1280}, "size_multiple 8 is not a multiple of 16"),
        ({"pipeline": "LTXPipeline"}, "the registry says LTXPipeline"),
        ({"pipeline_options": {"no_such_argument": 1}}, "takes no no_such_argument"),
    ],
)
async def test_a_model_its_pipeline_contradicts_stops_the_start(
    settings: Settings, tmp_path: Path, changes: dict[str, object], why: str
) -> None:
    folder = build_tiny_pipeline(tmp_path / "wan-tiny")
    spec = ModelSpec.model_validate(
        {"path": folder, "pipeline": "WanPipeline", "default_width": 32, "default_height": 32, **changes}
    )
    with pytest.raises(ValueError, match=why):
        await worker_service.start(worker_settings(settings, "wan-wrong", spec))


def test_a_model_runs_only_on_the_gpus_it_may_use() -> None:
    gpus = ["cuda:0", "cuda:1", "cuda:2", "cuda:1"]
    pinned = ModelSpec(kind="sleep", gpus=[1, 2])
    runners = runmod.load_runners({"pinned": pinned, "anywhere": ModelSpec(kind="sleep")}, gpus)
    assert sorted(runners) == [("anywhere", "cuda:0"), ("anywhere", "cuda:1"), ("anywhere", "cuda:2"),
                               ("pinned", "cuda:1"), ("pinned", "cuda:2")]
    assert runmod.model_devices("pinned", pinned, ["cpu"]) == ["cpu"]  # a CPU-only worker runs everything on its CPU
    with pytest.raises(ValueError, match=r"may use GPUs \[7\]"):
        runmod.model_devices("elsewhere", ModelSpec(kind="sleep", gpus=[7]), gpus)
