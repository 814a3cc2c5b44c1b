"""Image-to-video on the worker side: the family table's image classes, the tiny LTX-Video I2V pipeline end to end on
the CPU, the runner fitting a stored input to the frame, and an attempt reading its input from the result store."""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import hashlib
import inspect
import io
import json
import os
import sys
import typing
from collections.abc import AsyncIterator, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, cast

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import diffusers
import grpc
import pytest
import torch
from nats.errors import NoRespondersError
from PIL import Image

from services.worker import runner as runmod
from services.worker.devices import Devices
from services.worker.encoding import decode_mp4_info
from services.worker.inference import GenerationRequest, LoadOptions, VideoPipeline
from services.worker.retry import PermanentError, RetryableError
from services.worker.run import Attempts
from services.worker.runner import RunAborted
from services.worker.runstate import Halt, Run
from taskgate import images, results, store
from taskgate.config import ModelSpec, Settings
from taskgate.families import FAMILIES, IMAGE_TO_VIDEO, TEXT_TO_VIDEO
from taskgate.model import TaskRow
from taskgate.runtime import Backends
from taskgate.states import Status
from taskgate_api.v1 import gateway_pb2, gateway_pb2_grpc, task_pb2
from taskgate_local import tinymodel
from tests.support import factories, harness

I2V = "LTXImageToVideoPipeline"
IMAGE_PIPELINES = sorted(p for p, f in FAMILIES.items() if f.task_type == IMAGE_TO_VIDEO)
# Each image class and the text class whose transformer and VAE it shares.
TEXT_SIBLING = {
    "WanImageToVideoPipeline": "WanPipeline",
    "CogVideoXImageToVideoPipeline": "CogVideoXPipeline",
    "LTXImageToVideoPipeline": "LTXPipeline",
    "HunyuanVideoImageToVideoPipeline": "HunyuanVideoPipeline",
}


def _no_steps(_step: int, _total: int) -> None:
    """An on_step that ignores progress."""


def _never() -> bool:
    """A should_abort that never aborts."""
    return False


def _picture(width: int = 32, height: int = 32, tint: int = 0) -> Image.Image:
    """A smooth RGB gradient (a different one per tint), as a photo's pixels would be."""
    image = Image.new("RGB", (width, height))
    image.putdata(
        [
            ((x * 255) // width, (y * 255) // height, (tint * 80 + x + y) % 256)
            for y in range(height)
            for x in range(width)
        ]
    )
    return image


def _canonical(image: Image.Image) -> images.Canonical:
    """The image as the submit side stores it: checked, normalised, named by its sha256."""
    out = io.BytesIO()
    image.save(out, format="PNG")
    return images.canonical(out.getvalue(), images.Limits())


def _request(**changes: Any) -> GenerationRequest:
    """A small image-to-video request: 9 frames of 32x32 in 2 steps, from the default picture."""
    fields: dict[str, Any] = {
        "prompt": "a cat runs in the snow", "negative_prompt": "blurry", "num_frames": 9, "width": 32, "height": 32,
        "num_inference_steps": 2, "guidance_scale": 5.0, "fps": 8, "seed": 1, "image": _picture(),
    }
    fields.update(changes)
    return GenerationRequest(**fields)


# ---- the family table ----


def _transformer_class(pipeline: str) -> type:
    """The transformer class a diffusers pipeline class is built with (its __init__ annotation, Optional unwrapped)."""
    annotation = inspect.signature(getattr(diffusers, pipeline).__init__).parameters["transformer"].annotation
    found = [a for a in (typing.get_args(annotation) or (annotation,)) if a is not type(None)]
    assert len(found) == 1 and isinstance(found[0], type), annotation
    return found[0]


@pytest.mark.parametrize("pipeline", sorted(FAMILIES))
def test_a_family_gives_its_entries_its_task_type_unless_the_entry_says(pipeline: str) -> None:
    family = FAMILIES[pipeline]
    assert family.task_type in (TEXT_TO_VIDEO, IMAGE_TO_VIDEO)
    assert family.task_type == (IMAGE_TO_VIDEO if pipeline in TEXT_SIBLING else TEXT_TO_VIDEO)
    assert ModelSpec(pipeline=pipeline).task_types == [family.task_type]
    both: list[str] = [TEXT_TO_VIDEO, IMAGE_TO_VIDEO]
    assert ModelSpec(pipeline=pipeline, task_types=both).task_types == both


@pytest.mark.parametrize("pipeline", sorted(FAMILIES))
def test_the_table_says_what_the_installed_diffusers_does(pipeline: str) -> None:
    family = FAMILIES[pipeline]
    call = inspect.signature(getattr(diffusers, pipeline).__call__).parameters
    assert ("image" in call) == (family.task_type == IMAGE_TO_VIDEO)
    transformer = _transformer_class(pipeline)
    assert bool(getattr(transformer, "_repeated_blocks", None)) == family.repeated_blocks
    # set_attention_backend reaches only attention that goes through diffusers' dispatcher
    source = inspect.getsource(sys.modules[transformer.__module__])
    assert ("dispatch_attention_fn" in source) == family.attention_backends


@pytest.mark.parametrize("pipeline", IMAGE_PIPELINES)
def test_an_image_class_keeps_its_text_siblings_rules(pipeline: str) -> None:
    text = TEXT_SIBLING[pipeline]
    assert _transformer_class(pipeline) is _transformer_class(text)
    mine, theirs = dataclasses.asdict(FAMILIES[pipeline]), dataclasses.asdict(FAMILIES[text])
    differ = {name for name in mine if mine[name] != theirs[name]} - {"label", "task_type", "loads_from"}
    # CogVideoX-5b-I2V's learned positional embeddings fix its size at 720x480 (the transformer refuses others)
    assert differ == ({"max_width", "max_height"} if pipeline == "CogVideoXImageToVideoPipeline" else set())
    # LTX's one folder serves both
    assert FAMILIES[pipeline].loads_from == (("LTXPipeline",) if pipeline == I2V else ())


def test_cogvideox_1_0_i2v_is_held_to_its_one_size() -> None:
    spec = ModelSpec(pipeline="CogVideoXImageToVideoPipeline")
    assert (spec.default_width, spec.default_height, spec.max_width, spec.max_height) == (720, 480, 720, 480)
    larger = ModelSpec(pipeline="CogVideoXImageToVideoPipeline", max_width=1360, max_height=768, max_frames=81)
    assert (larger.max_width, larger.max_height, larger.max_frames) == (1360, 768, 81)


def test_image_fit_defaults_to_crop_and_pipeline_options_cannot_pass_an_image() -> None:
    assert ModelSpec().image_fit == "crop"
    assert ModelSpec(image_fit="pad").image_fit == "pad"
    with pytest.raises(ValueError, match="image_fit"):
        ModelSpec.model_validate({"image_fit": "stretch"})
    with pytest.raises(ValueError, match="may not set image"):
        ModelSpec(pipeline=I2V, pipeline_options={"image": "/tmp/x.png"})


def test_the_tiny_models_by_task_type() -> None:
    assert tinymodel.tiny_models(IMAGE_TO_VIDEO) == {"ltx-i2v-tiny": I2V}
    text = tinymodel.tiny_models(TEXT_TO_VIDEO)
    assert set(text) | {"ltx-i2v-tiny"} == set(tinymodel.TINY_MODELS) and "ltx-i2v-tiny" not in text


# ---- the tiny LTX-Video I2V pipeline ----


@pytest.fixture(scope="module", autouse=True)
def _one_torch_thread() -> Iterator[None]:
    """Run torch on one thread here: the tiny model gets slower, not faster, from more on a busy machine."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny LTX-Video I2V model, built once."""
    return tinymodel.build_tiny_pipeline(tmp_path_factory.mktemp("models") / "ltx-i2v-tiny", seed=0, pipeline=I2V)


@pytest.fixture(scope="module")
def i2v(model_dir: Path) -> VideoPipeline:
    """The tiny I2V model loaded on CPU in float32."""
    return VideoPipeline.load("ltx-i2v-tiny", model_dir, "cpu", torch.float32, LoadOptions(pipeline=I2V))


def test_the_folder_holds_the_image_class_with_the_text_models_networks(model_dir: Path, i2v: VideoPipeline) -> None:
    assert json.loads((model_dir / "model_index.json").read_text())["_class_name"] == I2V
    assert type(i2v.pipe).__name__ == I2V and i2v.takes_image
    spec = tinymodel.tiny_spec(I2V, model_dir)
    assert spec.task_types == [IMAGE_TO_VIDEO] and i2v.needs.violations(spec) == []


def test_an_image_becomes_a_video_of_the_requested_frames_and_size(i2v: VideoPipeline) -> None:
    video = i2v.generate(_request(), _no_steps, _never)
    assert (video.num_frames, video.width, video.height, video.fps, video.seed) == (9, 32, 32, 8, 1)
    assert decode_mp4_info(video.data) == (9, 32, 32)
    wide = i2v.generate(_request(num_frames=17, width=64, image=_picture(64, 32)), _no_steps, _never)
    assert decode_mp4_info(wide.data) == (17, 64, 32)


def test_same_seed_and_image_same_bytes_another_image_other_bytes(i2v: VideoPipeline) -> None:
    first = i2v.generate(_request(seed=7), _no_steps, _never)
    again = i2v.generate(_request(seed=7, image=_picture()), _no_steps, _never)  # an equal image, not the same object
    other_image = i2v.generate(_request(seed=7, image=_picture(tint=1)), _no_steps, _never)
    other_seed = i2v.generate(_request(seed=8), _no_steps, _never)
    assert first.sha256 == again.sha256
    assert len({first.sha256, other_image.sha256, other_seed.sha256}) == 3


def test_a_derived_seed_follows_the_image_and_a_text_requests_stays_as_it_was(i2v: VideoPipeline) -> None:
    unseeded = _request(seed=None)
    assert unseeded.resolved_seed() == _request(seed=None, image=_picture()).resolved_seed()
    assert unseeded.resolved_seed() != _request(seed=None, image=_picture(tint=1)).resolved_seed()
    assert i2v.generate(unseeded, _no_steps, _never).seed == unseeded.resolved_seed()
    # A text request's derived seed is the hash of its fields as before images existed (stored tasks re-run alike).
    text = dataclasses.replace(unseeded, image=None)
    fields = {f.name: getattr(text, f.name) for f in dataclasses.fields(text) if f.name not in ("seed", "image")}
    before = int.from_bytes(hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).digest()[:8], "big") >> 1
    assert text.resolved_seed() == before


def test_on_step_reports_each_step(i2v: VideoPipeline) -> None:
    steps: list[tuple[int, int]] = []
    i2v.generate(_request(num_inference_steps=3), lambda done, total: steps.append((done, total)), _never)
    assert steps == [(1, 3), (2, 3), (3, 3)]


def test_a_hard_cancel_stops_within_one_step_and_the_pipeline_still_works(i2v: VideoPipeline) -> None:
    baseline = i2v.generate(_request(seed=3), _no_steps, _never)
    steps: list[int] = []
    with pytest.raises(runmod.RunAborted):
        i2v.generate(
            _request(seed=3, num_inference_steps=4), lambda done, _total: steps.append(done), lambda: len(steps) >= 1
        )
    assert steps == [1]
    assert i2v.generate(_request(seed=3), _no_steps, _never).sha256 == baseline.sha256


def test_an_image_pipeline_without_an_image_or_with_a_wrong_sized_one_is_refused(i2v: VideoPipeline) -> None:
    steps: list[int] = []
    for request, why in (
        (_request(image=None), "the request has none"),
        (_request(image=_picture(64, 32)), "must be fitted"),
    ):
        with pytest.raises(ValueError, match=why) as caught:
            i2v.generate(request, lambda done, _total: steps.append(done), _never)
        assert runmod.classify(caught.value) == (False, "INVALID_PARAMETERS")
    assert steps == [], "refused before any step"


def test_a_text_pipeline_given_an_image_is_refused(i2v: VideoPipeline) -> None:
    from diffusers import LTXPipeline

    text = VideoPipeline("ltx-tiny", LTXPipeline(**i2v.pipe.components), "cpu", torch.float32)  # the same networks
    assert not text.takes_image
    with pytest.raises(ValueError, match="takes no image") as caught:
        text.generate(_request(), _no_steps, _never)
    assert runmod.classify(caught.value) == (False, "INVALID_PARAMETERS")
    assert decode_mp4_info(text.generate(_request(image=None), _no_steps, _never).data) == (9, 32, 32)


def test_warmup_gives_an_image_pipeline_a_blank_image(i2v: VideoPipeline, monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[Image.Image] = []
    call = type(i2v.pipe).__call__

    def noting(pipe: Any, **kwargs: Any) -> Any:
        seen.append(kwargs["image"])
        return call(pipe, **kwargs)

    monkeypatch.setattr(type(i2v.pipe), "__call__", noting)
    assert i2v.warmup() > 0
    assert (
        i2v.warmup(GenerationRequest(prompt="warmup", num_frames=9, width=64, height=32, num_inference_steps=1, seed=0))
        > 0
    )
    assert [(im.size, im.getextrema()) for im in seen] == [((32, 32), ((0, 0),) * 3), ((64, 32), ((0, 0),) * 3)]


# ---- the runner: a stored input fitted to the frame ----


def test_the_runner_fits_the_stored_image_the_models_way(i2v: VideoPipeline, model_dir: Path) -> None:
    stored = _canonical(_picture(48, 20))  # wider than the 32x32 frame: each fit makes other pixels
    params = {"num_frames": 9, "width": 32, "height": 32, "num_inference_steps": 2, "seed": 5}
    inp = runmod.RunInput(1, 1, "a cat runs", params, stored.png)
    digests = {}
    for fit in ("crop", "resize", "pad"):
        runner = runmod.DiffusersRunner("ltx-i2v-tiny", tinymodel.tiny_spec(I2V, model_dir, image_fit=fit), i2v)
        output = runner.encode(runner.render(inp, _no_steps, _never))
        assert decode_mp4_info(output.data) == (9, 32, 32)
        fitted = images.fit(images.open_canonical(stored.png), 32, 32, fit)
        expected = i2v.generate(
            _request(prompt="a cat runs", seed=5, negative_prompt="", image=fitted), _no_steps, _never
        )
        assert output.sha256 == expected.sha256, fit
        digests[fit] = output.sha256
    assert len(set(digests.values())) == 3


def test_the_runner_refuses_an_undecodable_input_and_a_missing_one(i2v: VideoPipeline, model_dir: Path) -> None:
    runner = runmod.DiffusersRunner("ltx-i2v-tiny", tinymodel.tiny_spec(I2V, model_dir), i2v)
    for image, why in ((b"not a png", "cannot be decoded"), (None, "the request has none")):
        with pytest.raises(ValueError, match=why) as caught:
            runner.render(runmod.RunInput(1, 1, "a cat", {"seed": 1}, image), _no_steps, _never)
        assert runmod.classify(caught.value) == (False, "INVALID_PARAMETERS")


def test_the_sleep_runner_shows_the_image_it_was_given() -> None:
    runner = runmod.SleepRunner("sleepy", ModelSpec(kind="sleep"))
    stored = _canonical(_picture())
    with_image = json.loads(
        runner.encode(runner.render(runmod.RunInput(1, 1, "p", {}, stored.png), _no_steps, _never)).data
    )
    without = json.loads(runner.encode(runner.render(runmod.RunInput(1, 1, "p", {}), _no_steps, _never)).data)
    assert with_image["image_sha256"] == stored.sha256 and "image_sha256" not in without


def test_input_failures_classify_as_final_or_retryable() -> None:
    assert runmod.classify(runmod.InputMissing("gone")) == (False, "INPUT_MISSING")
    assert runmod.classify(results.ResultStoreUnavailable("down")) == (True, "TRANSIENT_IO")


# ---- an attempt reads its input from the result store ----

NOW = datetime(2025, 1, 1, tzinfo=UTC)


def _task(payload: dict[str, Any]) -> TaskRow:
    """A claimed task of the sleep model with this request payload, retries left."""
    return TaskRow(
        id=7,
        user_id="tenant-a",
        idempotency_key="k",
        request_hash="h",
        task_type=IMAGE_TO_VIDEO,
        model_id="sleepy",
        prompt="a cat runs",
        request_payload=payload,
        priority=5,
        queue_name="sleepy",
        status=Status.PROCESSING,
        progress=0,
        version=3,
        attempt=1,
        retry_count=0,
        max_retries=3,
        created_at=NOW,
        updated_at=NOW,
    )


class _Flaky:
    """A result store in front of another whose reads fail with a NATS error `failures` times first."""

    def __init__(self, inner: results.ResultStore, failures: int) -> None:
        self.inner = inner
        self.failures = failures
        self.reads = 0

    async def read(self, uri: str) -> AsyncIterator[bytes]:
        self.reads += 1
        if self.reads <= self.failures:
            raise NoRespondersError
        async for chunk in self.inner.read(uri):
            yield chunk


@pytest.fixture
def folder_store(tmp_path: Path) -> results.FolderResults:
    """A folder result store."""
    return results.FolderResults(tmp_path / "results")


@pytest.fixture
def attempts_for(folder_store: results.FolderResults) -> Iterator[Any]:
    """Makes Attempts that run the sleep model on one CPU lane, reading inputs from a store (the folder's by
    default)."""
    spec = ModelSpec(kind="sleep")
    settings = Settings(
        database_url="postgresql://unused", nats_url="nats://unused", models={"sleepy": spec}, default_model="sleepy",
        lease_seconds=0.4, heartbeat_seconds=0.2,  # a store outage is ridden out for one lease
    )
    devices = Devices(["cpu"])
    encoders = concurrent.futures.ThreadPoolExecutor(1)

    def make(store: Any = folder_store) -> Attempts:
        return Attempts(
            pool=cast(Any, None), settings=settings, runners={("sleepy", "cpu"): runmod.SleepRunner("sleepy", spec)},
            devices=devices, encoders=encoders, progressed=lambda: None, inputs=store,
        )

    yield make
    devices.close()
    encoders.shutdown(wait=True)


def _run(task: TaskRow) -> Run:
    return Run(task, cast(Any, None), cast(Any, None))  # perform uses neither the message nor the slot


async def _stored(store: results.ResultStore, image: images.Canonical) -> dict[str, Any]:
    """The image put into the store as the submit side does, and its reference as the request payload holds it."""
    put = await store.put(image.name, image.png, images.CONTENT_TYPE)
    return {
        "sha256": image.sha256,
        "width": image.width,
        "height": image.height,
        "size_bytes": len(image.png),
        "uri": put.uri,
    }


async def test_an_attempt_reads_its_input_before_the_run(
    folder_store: results.FolderResults, attempts_for: Any
) -> None:
    image = _canonical(_picture())
    output = await attempts_for().perform(
        _run(_task({"num_inference_steps": 2, "image": await _stored(folder_store, image)}))
    )
    body = json.loads(output.data)
    assert body["image_sha256"] == image.sha256 and body["params"]["image"]["sha256"] == image.sha256
    text = json.loads((await attempts_for().perform(_run(_task({"num_inference_steps": 2})))).data)
    assert "image_sha256" not in text


async def test_a_missing_or_altered_input_fails_the_attempt_for_good(
    folder_store: results.FolderResults, attempts_for: Any
) -> None:
    ref = await _stored(folder_store, _canonical(_picture()))

    async def fails_for_good(image: dict[str, Any]) -> None:
        with pytest.raises(PermanentError) as caught:
            await attempts_for().perform(_run(_task({"image": image})))
        assert (caught.value.code, caught.value.dead_letter) == ("INPUT_MISSING", False)

    await fails_for_good(dict(ref, sha256=_canonical(_picture(tint=1)).sha256))  # the object holds other bytes
    await folder_store.delete(ref["uri"])
    await fails_for_good(ref)


async def test_a_store_outage_is_ridden_out_for_a_lease_then_retried(
    folder_store: results.FolderResults, attempts_for: Any
) -> None:
    image = _canonical(_picture())
    payload = {"image": await _stored(folder_store, image)}
    brief = _Flaky(folder_store, failures=2)
    output = await attempts_for(brief).perform(_run(_task(payload)))
    assert json.loads(output.data)["image_sha256"] == image.sha256 and brief.reads == 3
    with pytest.raises(RetryableError) as caught:
        await attempts_for(_Flaky(folder_store, failures=1000)).perform(_run(_task(payload)))
    assert caught.value.code == "TRANSIENT_IO" and caught.value.retry == 1


class _Hung:
    """A result store whose reads never answer (a stalled connection), and which says when one began."""

    def __init__(self) -> None:
        self.reading = asyncio.Event()

    async def read(self, uri: str) -> AsyncIterator[bytes]:
        self.reading.set()
        await asyncio.Event().wait()
        yield b""


async def test_a_stopped_run_does_not_wait_for_its_input_or_a_device(
    folder_store: results.FolderResults, attempts_for: Any
) -> None:
    """A drain (or a cancel) stops a run stuck in a store read, or queued for a held device, at once."""
    payload = {"image": await _stored(folder_store, _canonical(_picture()))}
    hung = _Hung()
    run = _run(_task(payload))
    performing = asyncio.create_task(attempts_for(hung).perform(run))
    await hung.reading.wait()
    run.stop(Halt.DRAIN)
    with pytest.raises(RunAborted):
        await asyncio.wait_for(performing, 10)

    attempts = attempts_for()
    lane = await attempts.devices.acquire({"cpu"})  # another run holds the only device
    queued = _run(_task({"num_inference_steps": 1}))
    performing = asyncio.create_task(attempts.perform(queued))
    await harness.wait_for(lambda: len(attempts.devices._waiting) == 1)
    queued.stop(Halt.DRAIN)
    with pytest.raises(RunAborted):
        await asyncio.wait_for(performing, 10)
    assert not attempts.devices._waiting  # it left the queue: the device goes to the next caller, not to it
    attempts.devices.release(lane)


async def test_a_malformed_image_reference_is_invalid(attempts_for: Any) -> None:
    with pytest.raises(PermanentError) as caught:
        await attempts_for().perform(_run(_task({"image": {"sha256": "ab"}})))
    assert caught.value.code == "INVALID_PARAMETERS"



# ---- through the services: the gateway stores the image, the worker runs the tiny I2V pipeline from it ----


def test_an_image_entry_loads_from_a_folder_saved_as_its_text_class(tmp_path: Path) -> None:
    """LTX-Video's published folder names LTXPipeline; an LTXImageToVideoPipeline entry serves it (as diffusers loads
    Lightricks/LTX-Video as either class); a folder of another family is still refused."""
    text_folder = tinymodel.build_tiny_pipeline(tmp_path / "ltx-tiny", pipeline="LTXPipeline")
    loaded = VideoPipeline.load("ltx-i2v", text_folder, "cpu", torch.float32, LoadOptions(pipeline=I2V))
    assert type(loaded.pipe).__name__ == I2V and loaded.takes_image
    wan = tinymodel.build_tiny_pipeline(tmp_path / "wan-tiny", pipeline="WanPipeline")
    with pytest.raises(ValueError, match="the folder holds a WanPipeline, the registry says LTXImageToVideoPipeline"):
        VideoPipeline.load("wrong", wan, "cpu", torch.float32, LoadOptions(pipeline=I2V))


def _png_bytes(tint: int) -> bytes:
    out = io.BytesIO()
    _picture(48, 40, tint=tint).save(out, format="PNG")
    return out.getvalue()


async def test_an_image_to_video_task_runs_end_to_end_through_the_services(
    settings: Settings, backends: Backends, model_dir: Path
) -> None:
    from services.submit import service as submit_service
    from services.worker import service as worker_service

    spec = tinymodel.tiny_spec(I2V, model_dir, image_fit="crop")
    run_settings = settings.model_copy(update={
        "models": {**settings.models, "ltx-i2v-tiny": spec}, "worker_models": ["ltx-i2v-tiny"], "worker_slots": 1,
        "progress_interval_seconds": 0.0,
    })
    gateway = await submit_service.start(run_settings, backends)
    worker = await worker_service.start(run_settings)
    try:
        md = await factories.key_for(backends, max_pending=10, submits_per_minute=100)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{gateway.port}") as channel:
            stub = gateway_pb2_grpc.TaskGatewayStub(channel)

            async def submit(tint: int, key: str) -> gateway_pb2.SubmitTaskResponse:
                request = gateway_pb2.SubmitTaskRequest(
                    task_type="image-to-video", model_id="ltx-i2v-tiny", prompt="the cat turns its head",
                    params=task_pb2.VideoParams(num_inference_steps=4, seed=7), idempotency_key=key,
                    image=gateway_pb2.ImageInput(data=_png_bytes(tint)),
                )
                answer: gateway_pb2.SubmitTaskResponse = await stub.SubmitTask(request, metadata=md, timeout=10)
                return answer

            # two runs of one image and seed (own keys: two tasks), one of another image
            tasks = [await submit(0, "a"), await submit(0, "b"), await submit(1, "c")]
            assert tasks[0].task.image.sha256 == tasks[1].task.image.sha256 != tasks[2].task.image.sha256
            rows: list[TaskRow] = []
            for t in tasks:
                async def finished(task_id: int = int(t.task.id)) -> bool:
                    row = await store.get_task(backends.pool, task_id)
                    return row is not None and row.status.terminal

                await harness.wait_for(finished, within=120)
                row = await store.get_task(backends.pool, int(t.task.id))
                assert row is not None
                assert row.status is Status.SUCCEEDED, (row.status, row.error_code, row.error_msg)
                rows.append(row)
        outputs = results.result_store(run_settings, backends.bus)
        for row in rows:
            assert row.result_uri is not None and row.result_content_type == "video/mp4"
            data = b"".join([chunk async for chunk in outputs.read(row.result_uri)])
            assert decode_mp4_info(data) == (9, 32, 32)  # the tiny model's default frames and size
        assert rows[0].result_sha256 == rows[1].result_sha256 != rows[2].result_sha256
        progress = [
            r["progress"]
            for r in await backends.pool.fetch(
                "SELECT progress FROM task_event WHERE task_id = $1 AND to_status = 'PROCESSING' ORDER BY version",
                rows[0].id,
            )
        ]
        assert progress[0] == 0 and progress == sorted(progress) and progress[-1] > 0
    finally:
        await worker.stop(grace=0)
        await gateway.stop(0)
