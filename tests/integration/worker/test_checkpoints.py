"""Step checkpoints: a run interrupted after step k resumes there on another worker, and its video is byte for byte the
one an uninterrupted run of the same seed makes — per family of the tiny pipelines, against real PostgreSQL, NATS and
worker processes that are SIGKILLed or SIGTERMed mid-run."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np
import pytest
import torch
from PIL import Image

from services.scheduler import service as scheduler_service
from services.worker import checkpoint, resume
from services.worker import service as worker_service
from services.worker.engine import TestSignals
from services.worker.inference import GenerationRequest, LoadOptions, VideoPipeline
from taskgate import results
from taskgate.config import Settings
from taskgate.families import TEXT_TO_VIDEO
from taskgate.runtime import Backends
from taskgate.states import Priority, Status
from taskgate.store import workers
from taskgate_local import tinymodel
from tests.support.factories import params, submit
from tests.support.harness import stored_objects, wait_for, worker_process
from tests.support.queries import events, is_status, read_result, row, wait_task

TEXT_MODELS = tinymodel.tiny_models(TEXT_TO_VIDEO)


@pytest.fixture(scope="module", autouse=True)
def _one_torch_thread() -> Iterator[None]:
    """Run torch on one thread here: these tiny models get slower, not faster, from more on a busy machine."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Every tiny model, built once for this module."""
    base = tmp_path_factory.mktemp("models")
    return {
        name: tinymodel.build_tiny_pipeline(base / name, pipeline=cls) for name, cls in tinymodel.TINY_MODELS.items()
    }


# ---- the pipeline itself: every family, every step ----


class EveryStep:
    """A capture that keeps a snapshot after every step (in memory)."""

    def __init__(self) -> None:
        self.snapshots: dict[int, checkpoint.Snapshot] = {}

    def due(self, step: int, total: int) -> bool:
        return step < total

    def keep(self, snapshot: checkpoint.Snapshot) -> None:
        self.snapshots[snapshot.step] = snapshot


@pytest.mark.parametrize("name", sorted(tinymodel.TINY_MODELS))
def test_a_run_resumed_from_any_step_makes_the_uninterrupted_runs_bytes(models: dict[str, Path], name: str) -> None:
    cls = tinymodel.TINY_MODELS[name]
    pipeline = VideoPipeline.load(name, models[name], "cpu", torch.float32, LoadOptions(pipeline=cls))
    assert pipeline.not_resumable is None
    size, frames = 2 * pipeline.needs.size_multiple, 1 + 2 * pipeline.needs.frame_step
    req = GenerationRequest(
        prompt="a cat runs in the snow", num_frames=frames, width=size, height=size, num_inference_steps=5, seed=3
    )
    if pipeline.takes_image:
        pixels = (np.arange(size * size * 3) % 251).astype(np.uint8).reshape(size, size, 3)
        req = GenerationRequest(**{**req.__dict__, "image": Image.fromarray(pixels)})
    taken = EveryStep()
    whole = pipeline.encode(pipeline.render(req, lambda _s, _t: None, lambda: False, capture=taken))
    assert sorted(taken.snapshots) == [1, 2, 3, 4]  # none after the last step: nothing is left to resume
    for step, snapshot in sorted(taken.snapshots.items()):
        stored = checkpoint.decode(snapshot.encode())  # through its stored form, as another worker reads it
        assert (stored.step, stored.total, stored.fingerprint) == (step, 5, snapshot.fingerprint)
        rendered = pipeline.render(req, lambda _s, _t: None, lambda: False, resume=stored)
        assert rendered.resumed_from == step
        assert pipeline.encode(rendered).data == whole.data, f"{name} resumed from step {step}"

    # a checkpoint of another request (here: another seed) is not applied: that run starts from step 0
    other = GenerationRequest(**{**req.__dict__, "seed": 4})
    assert pipeline.render(other, lambda _s, _t: None, lambda: False, resume=taken.snapshots[2]).resumed_from == 0


def test_bytes_that_are_no_checkpoint_are_refused() -> None:
    with pytest.raises(checkpoint.BadCheckpoint):
        checkpoint.decode(b"not a checkpoint")
    from safetensors.torch import save

    with pytest.raises(checkpoint.BadCheckpoint):
        checkpoint.decode(save({"latents": torch.zeros(2)}, metadata={"format": "something else"}))


def test_a_multistep_scheduler_is_not_resumed_and_says_why(models: dict[str, Path]) -> None:
    from diffusers import UniPCMultistepScheduler

    pipeline = VideoPipeline.load(
        "wan-tiny", models["wan-tiny"], "cpu", torch.float32, LoadOptions(pipeline="WanPipeline")
    )
    pipeline.pipe.scheduler = UniPCMultistepScheduler.from_config(pipeline.pipe.scheduler.config)
    assert pipeline.not_resumable is not None and "UniPCMultistepScheduler" in pipeline.not_resumable


# ---- worker processes killed and drained mid-run ----


def checkpointing(settings: Settings, model: str, folder: Path) -> Settings:
    """One model taking a checkpoint after every step; one-slot workers; leases short enough that a dead worker's task
    is handed on in about a second."""
    spec = tinymodel.tiny_spec(TEXT_MODELS.get(model, "WanPipeline"), folder, checkpoint_every_steps=1)
    return settings.model_copy(
        update={
            "models": {**settings.models, model: spec},
            "worker_models": [model],
            "worker_slots": 1,
            "lease_seconds": 1.0,
            "heartbeat_seconds": 0.25,
            "scan_interval_seconds": 0.2,
            "progress_interval_seconds": 0.0,
        }
    )


# long enough per step (tens of milliseconds) that a test sees the run part way
LONG = {"num_frames": 33, "width": 64, "height": 64}


async def checkpointed_past(backends: Backends, task_id: int, step: int) -> None:
    async def past() -> bool:
        current = await row(backends.pool, task_id)
        return current.checkpoint_step >= step or current.status.terminal

    await wait_for(past, within=120, every=0.02)


async def uninterrupted(
    backends: Backends, model: str, request: dict[str, object], handle: worker_service.WorkerHandle
) -> bytes:
    """The video a run of the same request makes without interruption (another task, the same seed)."""
    task = await submit(backends, model=model, params=request)
    done = await wait_task(backends, task.id, is_status(Status.SUCCEEDED), within=180)
    assert done.result_uri is not None and done.attempt == 1
    return await read_result(handle.worker.settings, backends, done.result_uri)


@pytest.mark.parametrize("model", sorted(TEXT_MODELS))
async def test_a_killed_workers_task_resumes_on_another_from_its_checkpoint_with_identical_bytes(
    settings: Settings, backends: Backends, models: dict[str, Path], model: str
) -> None:
    s = checkpointing(settings, model, models[model])
    request = params(steps=100, seed=11, **LONG)
    sched = await scheduler_service.start(s, backends)
    try:
        task = await submit(backends, model=model, params=request)
        async with worker_process(s) as first:
            await checkpointed_past(backends, task.id, 3)
            first.kill()  # SIGKILL: nothing is released, the lease just lapses
            await first.wait()
        assert (await row(backends.pool, task.id)).status is Status.PROCESSING, "the run ended before the kill"
        # its lease lapses and the scheduler queues it again; a checkpoint write sent just before the kill has landed
        # by then (none lands after: the write needs the attempt's lease)
        lost = await wait_task(backends, task.id, is_status(Status.QUEUED), within=30)
        assert lost.checkpoint_uri is not None and lost.worker_losses == 1
        resumed_at = lost.checkpoint_step

        signals = TestSignals().arm()
        second = await worker_service.start(s, signals=signals)
        try:
            done = await wait_task(backends, task.id, is_status(Status.SUCCEEDED), within=180)
            assert done.attempt == 2 and done.result_uri is not None
            # the second attempt began at the checkpoint: its first snapshot is the step after it, none before
            steps = [k.step for k in signals.checkpointed.seen if k.task_id == task.id]
            assert steps and min(steps) == resumed_at + 1
            video = await read_result(s, backends, done.result_uri)
            assert video == await uninterrupted(backends, model, request, second)
            # the checkpoint goes with the task's end (its worker deletes it right after the final write)
            await wait_task(
                backends, task.id, lambda r: r.checkpoint_uri is None and r.checkpoint_garbage == [], within=10
            )
            assert await stored_objects(backends.bus, f"checkpoints/{task.id}-") == []
        finally:
            await second.stop(grace=0)
    finally:
        await sched.stop()


async def test_sigterm_checkpoints_releases_and_exits_within_seconds_and_the_next_worker_resumes(
    settings: Settings, backends: Backends, models: dict[str, Path]
) -> None:
    model = "wan-tiny"
    s = checkpointing(settings, model, models[model])
    request = params(steps=100, seed=12, **LONG)
    task = await submit(backends, model=model, params=request)
    async with worker_process(s) as first:
        await checkpointed_past(backends, task.id, 3)
        signalled = time.monotonic()
        first.send_signal(signal.SIGTERM)
        code = await asyncio.wait_for(first.wait(), 30)
        exit_seconds = time.monotonic() - signalled
    assert code == 0 and exit_seconds < 5, (code, exit_seconds)
    released = await row(backends.pool, task.id)
    # released to the queue, not failed, no retry spent, no worker counted lost; its checkpoint is where it stopped
    assert released.status is Status.QUEUED and (released.retry_count, released.worker_losses) == (0, 0)
    assert released.checkpoint_uri is not None and released.checkpoint_step >= 3
    stopped_at = released.checkpoint_step
    # metering: its steps up to the checkpoint counted; at most the moments after the stop's snapshot are wasted
    assert released.device_seconds > 0 and released.wasted_seconds < 0.5, (
        released.device_seconds,
        released.wasted_seconds,
    )

    signals = TestSignals().arm()
    second = await worker_service.start(s, signals=signals)
    try:
        done = await wait_task(backends, task.id, is_status(Status.SUCCEEDED), within=180)
        steps = [k.step for k in signals.checkpointed.seen if k.task_id == task.id]
        assert steps and min(steps) == stopped_at + 1
        assert done.result_uri is not None
        assert await read_result(s, backends, done.result_uri) == await uninterrupted(backends, model, request, second)
    finally:
        await second.stop(grace=0)


async def test_a_fenced_out_attempts_checkpoint_is_refused_and_an_ended_tasks_is_collected(
    settings: Settings, backends: Backends
) -> None:
    task = await submit(backends, params=params())
    # no attempt runs it: the writes are refused
    assert not await workers.name_checkpoint(backends.pool, task.id, attempt=1, uri="nats-os://x/y")
    assert await workers.record_checkpoint(backends.pool, task.id, attempt=1, uri="nats-os://x/y", step=2) is None
    results_store = results.result_store(settings, backends.bus)
    stored = await results_store.put(resume.object_name(task.id, 1, 2), b"snapshot", resume.CONTENT_TYPE)
    replaced = await results_store.put(resume.object_name(task.id, 1, 1), b"older snapshot", resume.CONTENT_TYPE)
    await backends.pool.execute(
        "UPDATE task SET checkpoint_uri = $2, checkpoint_step = 2, checkpoint_garbage = $3, status = 'CANCELED',"
        " finished_at = now(), version = version + 1, cancel_mode = 'hard' WHERE id = $1",
        task.id, stored.uri, [replaced.uri],
    )
    sched = await scheduler_service.start(settings.model_copy(update={"scan_interval_seconds": 0.2}), backends)
    try:
        async def collected() -> bool:
            current = await row(backends.pool, task.id)
            return current.checkpoint_uri is None and current.checkpoint_garbage == []

        await wait_for(collected, within=30)
        assert await stored_objects(backends.bus, f"checkpoints/{task.id}-") == []
    finally:
        await sched.stop()


# ---- priority preemption ----


async def test_a_high_task_preempts_a_long_low_one_which_resumes_later_with_identical_bytes(
    settings: Settings, backends: Backends, models: dict[str, Path]
) -> None:
    model = "wan-tiny"
    s = checkpointing(settings, model, models[model])
    spec = s.models[model].model_copy(update={"preempt_after_seconds": 0.5})
    s = s.model_copy(update={"models": {**s.models, model: spec}})
    request = params(steps=100, seed=13, **LONG)
    sched = await scheduler_service.start(s, backends)
    signals = TestSignals().arm()
    handle = await worker_service.start(s, signals=signals)
    try:
        low = await submit(backends, model=model, params=request, priority=Priority.LOW)
        await checkpointed_past(backends, low.id, 3)
        submitted = time.monotonic()
        high = await submit(backends, model=model, params=params(steps=2, seed=1), priority=Priority.HIGH)
        started = await wait_task(backends, high.id, lambda r: r.started_at is not None, within=60)
        waited = time.monotonic() - submitted
        done_low = await wait_task(backends, low.id, is_status(Status.SUCCEEDED), within=300)
        done_high = await row(backends.pool, high.id)
        assert done_high.status is Status.SUCCEEDED and started.started_at is not None
        assert done_high.finished_at is not None and done_low.finished_at is not None
        assert done_high.finished_at < done_low.finished_at  # it did not wait for the whole LOW run
        # preempt_after, a scan pass and a step or two, not the LOW run's remaining ~90 steps
        assert waited < 10, waited
        preempted = [e for e in await events(backends, low.id) if e["reason"] == "PREEMPTED"]
        assert len(preempted) == 1 and preempted[0]["to_status"] == "QUEUED"  # once: no thrashing
        assert (done_low.attempt, done_low.retry_count, done_low.worker_losses) == (2, 0, 0)
        steps = [k.step for k in signals.checkpointed.seen if k.task_id == low.id and k.attempt == 2]
        first = [k.step for k in signals.checkpointed.seen if k.task_id == low.id and k.attempt == 1]
        assert steps and min(steps) == max(first) + 1  # resumed at the checkpoint taken when it was preempted
        assert done_low.result_uri is not None
        video = await read_result(s, backends, done_low.result_uri)
        assert video == await uninterrupted(backends, model, request, handle)
    finally:
        await handle.stop(grace=0)
        await sched.stop()
