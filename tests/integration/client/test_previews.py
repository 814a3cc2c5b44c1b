"""Preview frames and worker log lines of a running video, end to end on the real tiny pipelines: made from the latents
at step ends, stored, and carried by the task's output stream over WatchTask (dropped and resumed), SSE, the SDK
(`handle.previews()`, `handle.logs()`) and the CLI (`taskgate logs`)."""

from __future__ import annotations

import asyncio
import io
import json
import os
import re
from collections.abc import AsyncIterator, Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, cast

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import grpc
import httpx
import numpy as np
import pytest
import torch
from PIL import Image

from services.http.dashboard import Dashboard
from services.scheduler.retention import Retention
from services.scheduler.scans import Action
from services.worker import partial
from services.worker.inference import GenerationRequest, LoadOptions, VideoPipeline
from taskgate import output
from taskgate.config import Settings
from taskgate.families import TEXT_TO_VIDEO
from taskgate.runtime import Backends
from taskgate_api.v1 import events_pb2, events_pb2_grpc, gateway_pb2, gateway_pb2_grpc, task_pb2
from taskgate_client import connect_async
from taskgate_local import tinymodel
from tests.support import harness
from tests.support.harness import HttpStack
from tests.support.stacks import Cli

MODEL = "wan-tiny"
SIZE, FRAMES, STEPS = 48, 3, 12  # previews due every quarter of 12 steps: after steps 3, 6 and 9 (none after the last)
REQUEST = {"width": 64, "height": 32, "num_frames": 17, "num_inference_steps": STEPS, "seed": 5}


@pytest.fixture(scope="module", autouse=True)
def _one_torch_thread() -> Iterator[None]:
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("models")
    return {
        name: tinymodel.build_tiny_pipeline(base / name, pipeline=cls) for name, cls in tinymodel.TINY_MODELS.items()
    }


# ---- the projection, every family ----


class Sink:
    """The device side of a Partial without its writer: the frames each due step's latents project to."""

    def __init__(self, projection: partial.Projection) -> None:
        self.every = partial.Every(0.25, 0.0)
        self.projection = projection
        self.frames: dict[int, Any] = {}

    def due(self, step: int, total: int) -> bool:
        return self.every.due(step, total)

    def take(self, step: int, latents: Any, grid: tuple[int, int, int], aspect: tuple[int, int]) -> None:
        self.every.taken(step)
        self.frames[step] = (partial.project(latents, self.projection, grid), aspect)


@pytest.mark.parametrize("name", sorted(tinymodel.tiny_models(TEXT_TO_VIDEO)))
def test_every_family_projects_its_latents_to_preview_frames_without_changing_the_video(
    models: dict[str, Path], name: str
) -> None:
    cls = tinymodel.TINY_MODELS[name]
    pipeline = VideoPipeline.load(name, models[name], "cpu", torch.float32, LoadOptions(pipeline=cls))
    width, height = 4 * pipeline.needs.size_multiple, 2 * pipeline.needs.size_multiple
    req = GenerationRequest(
        prompt="a fox in the snow",
        num_frames=1 + 4 * pipeline.needs.frame_step,
        width=width,
        height=height,
        num_inference_steps=8,
        seed=2,
    )
    sink = Sink(partial.Projection(pipeline.preview_layout, FRAMES))
    with_previews = pipeline.encode(pipeline.render(req, lambda _s, _t: None, lambda: False, preview=sink))  # type: ignore[arg-type]
    assert sorted(sink.frames) == [2, 4, 6]
    for step, (frames, aspect) in sink.frames.items():
        assert frames is not None, f"{name}: no frames at step {step}"
        assert frames.dtype == np.uint8 and frames.ndim == 4 and frames.shape[0] == FRAMES and frames.shape[-1] == 3
        assert frames.shape[2] == 2 * frames.shape[1]  # the latents keep the video's 2:1 aspect
        assert frames.max() > frames.min(), f"{name}: a blank preview at step {step}"
        data, w, h = partial.encode_image(frames, SIZE, "webp", aspect)
        with Image.open(io.BytesIO(data)) as image:
            assert image.format == "WEBP" and image.size == (w, h) == (FRAMES * SIZE, SIZE // 2)
    # a preview reads the latents, never changes them: the video is the one a run without previews makes
    assert pipeline.encode(pipeline.render(req, lambda _s, _t: None, lambda: False)).data == with_previews.data


# ---- through the services ----


@pytest.fixture
def settings(settings: Settings, models: dict[str, Path]) -> Settings:
    spec = tinymodel.tiny_spec(
        "WanPipeline", models[MODEL], preview_every_fraction=0.25, preview_size=SIZE, preview_frames=FRAMES
    )
    return settings.model_copy(update={"models": {**settings.models, MODEL: spec}, "stream_keepalive_seconds": 1.0})


@pytest.fixture
async def stack(settings: Settings, backends: Backends) -> AsyncIterator[HttpStack]:
    async with harness.http_stack(settings, backends, worker_models=[MODEL]) as s:
        yield s


def image_of(data: bytes) -> tuple[str | None, tuple[int, int]]:
    with Image.open(io.BytesIO(data)) as image:
        image.load()  # decodes every pixel: a truncated file fails here
        return image.format, image.size


async def sse_outputs(
    client: httpx.AsyncClient, task_id: str, last_event_id: str | None = None
) -> list[dict[str, Any]]:
    """Every `output` event of the task's SSE stream until it ends (from Last-Event-ID when given)."""
    found = []
    headers = {"last-event-id": last_event_id} if last_event_id else {}
    async with client.stream("GET", f"/v1/tasks/{task_id}/events", headers=headers) as response:
        assert response.status_code == 200
        event, data, ident = "", "", ""
        async for line in response.aiter_lines():
            if line.startswith("event:"):
                event = line.partition(":")[2].strip()
            elif line.startswith("data:"):
                data = line.partition(":")[2].strip()
            elif line.startswith("id:"):
                ident = line.partition(":")[2].strip()
            elif not line and event == "output":
                found.append({**json.loads(data), "_id": ident})
                event = ""
    return found


async def test_a_running_videos_previews_and_log_lines_reach_watch_task_sse_the_sdk_and_the_cli(
    stack: HttpStack, backends: Backends, tmp_path: Path
) -> None:
    md = (("authorization", f"Bearer {stack.api_key}"),)
    async with (
        grpc.aio.insecure_channel(f"127.0.0.1:{stack.submit.port}") as gw_channel,
        grpc.aio.insecure_channel(f"127.0.0.1:{stack.notifier.port}") as ev_channel,
        httpx.AsyncClient(base_url=stack.url, headers=stack.headers(), timeout=60) as http,
        connect_async(
            f"127.0.0.1:{stack.submit.port}", stack.api_key, events_address=f"127.0.0.1:{stack.notifier.port}"
        ) as sdk,
    ):
        gateway = gateway_pb2_grpc.TaskGatewayStub(gw_channel)
        events = events_pb2_grpc.TaskEventsStub(ev_channel)
        made = await http.post("/v1/tasks", json={"prompt": "a red fox runs", "model_id": MODEL, "params": REQUEST})
        assert made.status_code == 201, made.text
        task_id = made.json()["task"]["id"]
        over_sse = asyncio.create_task(sse_outputs(http, task_id))
        over_sdk = asyncio.create_task(_collect(sdk.previews(task_id)))

        # WatchTask: the first preview, the connection dropped, the rest from where it stopped
        call = events.WatchTask(events_pb2.WatchTaskRequest(task_id=task_id, include_output=True), metadata=md)
        first: list[task_pb2.OutputChunk] = []
        version = 0
        async with asyncio.timeout(120):
            while not any(c.kind == task_pb2.OUTPUT_KIND_PREVIEW for c in first):
                msg = await call.read()
                assert msg is not grpc.aio.EOF, "the stream ended before a preview"
                kind = msg.WhichOneof("kind")
                if kind == "output":
                    first.append(msg.output)
                elif kind == "snapshot":
                    version = msg.snapshot.version
                elif kind == "event":
                    version = msg.event.version
                    assert msg.event.to_status != task_pb2.TASK_STATUS_SUCCEEDED, (
                        "the task ended before its first preview"
                    )
        call.cancel()
        rest: list[task_pb2.OutputChunk] = []
        last_event = None
        resumed = events.WatchTask(
            events_pb2.WatchTaskRequest(
                task_id=task_id,
                include_output=True,
                after_version=version,
                after_output_sequence=first[-1].sequence,
            ),
            metadata=md,
        )
        async with asyncio.timeout(120):
            async for msg in resumed:
                if msg.WhichOneof("kind") == "output":
                    rest.append(msg.output)
                elif msg.WhichOneof("kind") == "event":
                    last_event = msg.event
        assert last_event is not None and last_event.to_status == task_pb2.TASK_STATUS_SUCCEEDED
        chunks = first + rest
        sequences = [c.sequence for c in chunks]
        assert sequences == sorted(set(sequences))  # in order, none twice across the reconnect
        assert chunks == await _stored(backends, task_id)  # and none missed: every chunk the stream holds

        previews = [c for c in chunks if c.kind == task_pb2.OUTPUT_KIND_PREVIEW]
        # the first is always made (the writer is idle); one due while the writer still stores an older one replaces
        # any waiting (a slow store never holds the device nor builds a queue), and none is made after the last step
        steps = [p.step for p in previews]
        assert steps[0] == 3 and steps == sorted(set(steps)) and set(steps) <= {3, 6, 9}, steps
        for p in previews:
            assert p.attempt == 1 and p.content_type == "image/webp"
            data = b"".join(
                [
                    c.data
                    async for c in gateway.GetTaskResult(
                        gateway_pb2.GetTaskResultRequest(task_id=task_id, preview_uri=p.uri), metadata=md
                    )
                ]
            )
            assert image_of(data) == ("WEBP", (FRAMES * SIZE, SIZE // 2))  # 3 frames of 48 x 24 (the video is 64 x 32)
            got_http = await http.get(f"/v1/tasks/{task_id}/previews", params={"uri": p.uri})
            assert got_http.status_code == 200 and got_http.headers["content-type"] == "image/webp"
            assert got_http.content == data

        lines = [c.text for c in chunks if c.kind == task_pb2.OUTPUT_KIND_LOG]
        assert [c.offset for c in chunks if c.kind == task_pb2.OUTPUT_KIND_LOG] == list(range(1, len(lines) + 1))
        assert lines[0] == "attempt 1 starts at step 0"
        assert lines[1].startswith(f"model {MODEL} on cpu: loaded in ") and "warm-up" in lines[1]
        assert lines[2].startswith("device phase ") and "denoise" in lines[2] and "decode" in lines[2]
        assert re.search(r"; [0-3] previews so far$", lines[2]), lines[2]
        assert lines[3].startswith("encoded ") and "video/mp4" in lines[3]

        # another task's preview, or a name outside the previews, is not served
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            async for _ in gateway.GetTaskResult(
                gateway_pb2.GetTaskResultRequest(
                    task_id=task_id, preview_uri=previews[0].uri.replace(f"/{task_id}-", "/1-")
                ),
                metadata=md,
            ):
                pass
        assert refused.value.code() == grpc.StatusCode.NOT_FOUND
        elsewhere = await http.get(f"/v1/tasks/{task_id}/previews", params={"uri": "file:///etc/passwd"})
        assert elsewhere.status_code == 404

        # SSE: the same chunks as output events; resumed from the id of its first preview, the rest and nothing else
        sse = await asyncio.wait_for(over_sse, 60)
        assert [int(c["sequence"]) for c in sse] == sequences
        assert [c["kind"] for c in sse if int(c.get("step", 0))] == ["OUTPUT_KIND_PREVIEW"] * len(previews)
        at = next(i for i, c in enumerate(sse) if c["kind"] == "OUTPUT_KIND_PREVIEW")
        again = await sse_outputs(http, task_id, last_event_id=sse[at]["_id"])
        assert [int(c["sequence"]) for c in again] == sequences[at + 1 :]

        # the SDK: each preview with its bytes, in order
        got = await asyncio.wait_for(over_sdk, 60)
        assert [(p.step, p.uri) for p in got] == [(p.step, p.uri) for p in previews]
        assert all(p.data is not None and image_of(p.data)[0] == "WEBP" for p in got)
        assert [line.text async for line in sdk.logs(task_id)] == lines

    # the dashboard: the newest preview of a task (the running table shows it for a model that makes previews)
    async with httpx.AsyncClient(base_url=stack.url, timeout=30) as web:
        assert (await web.get(f"/dashboard/tasks/{task_id}/preview")).status_code == 401  # no session
        assert (await web.post("/dashboard/login", data={"key": stack.admin_key})).status_code == 303
        newest = await web.get(f"/dashboard/tasks/{task_id}/preview")
        assert newest.status_code == 200 and newest.headers["content-type"] == "image/webp"
        async with grpc.aio.insecure_channel(f"127.0.0.1:{stack.submit.port}") as channel:
            last = b"".join([c.data async for c in gateway_pb2_grpc.TaskGatewayStub(channel).GetTaskResult(
                gateway_pb2.GetTaskResultRequest(task_id=task_id, preview_uri=previews[-1].uri), metadata=md)])
        assert newest.content == last
        assert (await web.get("/dashboard/tasks/1/preview")).status_code == 404
        page = Dashboard(cast(Any, None), stack.settings)  # its templates, as the service renders them
        rendered = page.env.get_template("running.html").render(view=_running_view(task_id), operator=True)
        assert (
            f'src="/dashboard/tasks/{task_id}/preview?at=40"' in rendered
            and f"Newest preview of task {task_id}" in rendered
        )

    # retention: the previews go with the task's output (each named on the row before it was stored)
    named = await backends.pool.fetchval("SELECT preview_uris FROM task WHERE id = $1", int(task_id))
    assert sorted(named) == sorted(p.uri for p in previews)
    purged = await stack.scheduler.scheduler.retention.purge(Retention(results=3600.0), now=_hours_later(), limit=100)
    assert purged.actions[Action.PURGE_RESULT] >= 1 + len(previews)  # the video and every preview
    assert await backends.pool.fetchval("SELECT preview_uris FROM task WHERE id = $1", int(task_id)) == []
    async with grpc.aio.insecure_channel(f"127.0.0.1:{stack.submit.port}") as channel:
        for p in previews:
            with pytest.raises(grpc.aio.AioRpcError) as gone:
                async for _ in gateway_pb2_grpc.TaskGatewayStub(channel).GetTaskResult(
                    gateway_pb2.GetTaskResultRequest(task_id=task_id, preview_uri=p.uri), metadata=md
                ):
                    pass
            assert gone.value.code() == grpc.StatusCode.NOT_FOUND

    # the CLI: the task's log lines, with and without --follow
    env = {k: v for k, v in os.environ.items() if not k.startswith("TASKGATE_")} | {
        "TASKGATE_ADDRESS": f"127.0.0.1:{stack.submit.port}",
        "TASKGATE_EVENTS_ADDRESS": f"127.0.0.1:{stack.notifier.port}",
        "TASKGATE_API_KEY": stack.api_key,
        "TASKGATE_STATE_DIR": str(tmp_path / "state"),
        "PYTHONPATH": str(harness.ROOT),
    }
    cli = Cli(env, tmp_path, stack.settings, backends)
    for args in (("logs", task_id), ("logs", task_id, "--follow")):
        ran = await cli(*args)
        assert ran.code == 0, ran.err
        printed = ran.out.splitlines()
        assert [line.split(": ", 1)[1] for line in printed] == lines, printed
        assert all(" attempt 1: " in line for line in printed)
    as_json = await cli("logs", task_id, "--json")
    assert [json.loads(line)["text"] for line in as_json.out.splitlines()] == lines


def _running_view(task_id: str) -> Any:
    from types import SimpleNamespace

    from services.http.dashboard_view import TaskLine

    line = TaskLine(
        id=task_id,
        tenant="tenant-a",
        model=MODEL,
        status="PROCESSING",
        priority="NORMAL",
        prompt="a fox",
        progress=40,
        attempt=1,
        worker="w",
        error_code="",
        error_message="",
        replay_of="",
        updated=None,
        started=None,
        finished=None,
    )
    return SimpleNamespace(running_tasks=[line], running_more=False, replays={})


def _hours_later() -> datetime:
    return datetime.now(UTC) + timedelta(hours=2)


async def _collect(items: AsyncIterator[Any]) -> list[Any]:
    return [item async for item in items]


async def _stored(backends: Backends, task_id: str) -> list[task_pb2.OutputChunk]:
    from tests.support.output import chunks

    return await chunks(backends, "tenant-a", task_id)


def test_a_preview_uri_names_only_its_own_tasks_previews(tmp_path: Path) -> None:
    from taskgate.results import FolderResults

    store = FolderResults(tmp_path)
    own = store.uri_of(output.preview_name(42, 1, 3, "webp"))
    assert output.is_preview_of(store, 42, own)
    assert not output.is_preview_of(store, 4, own)  # a task id that is a prefix of another's
    assert not output.is_preview_of(store, 42, store.uri_of("42.mp4"))
    assert not output.is_preview_of(store, 42, own.replace("-s3.webp", "-s3/../../x.webp"))
    assert not output.is_preview_of(store, 42, own + ".mp4")
