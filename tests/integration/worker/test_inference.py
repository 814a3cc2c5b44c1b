"""Tests for the inference layer against every text family's tiny offline pipeline (Wan, CogVideoX, LTX-Video,
HunyuanVideo); the image-to-video one is tests/integration/worker/test_image_to_video.py's."""

from __future__ import annotations

import hashlib
import importlib.util
import io
import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tests.support.harness import ROOT

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import av
import numpy as np
import pytest
import torch

from services.worker.encoding import decode_mp4_info, encode_mp4
from services.worker.inference import (
    GeneratedVideo,
    GenerationRequest,
    LoadOptions,
    VideoPipeline,
    pick_device,
    resolve_dtype,
)
from services.worker.runner import RunAborted, classify
from taskgate.families import FAMILIES, TEXT_TO_VIDEO
from taskgate_local import tinymodel


def _request(**changes: object) -> GenerationRequest:
    """A small request: 9 frames of 32x32 in 2 steps."""
    fields: dict[str, object] = {
        "prompt": "a cat runs in the snow",
        "negative_prompt": "blurry",
        "num_frames": 9,
        "width": 32,
        "height": 32,
        "num_inference_steps": 2,
        "guidance_scale": 5.0,
        "fps": 8,
        "seed": 1,
    }
    fields.update(changes)
    return GenerationRequest(**fields)  # type: ignore[arg-type]


def _no_steps(_step: int, _total: int) -> None:
    """An on_step that ignores progress."""


def _never() -> bool:
    """A should_abort that never aborts."""
    return False


@pytest.fixture(scope="module", autouse=True)
def _one_torch_thread() -> Iterator[None]:
    """Run torch on one thread here: these tiny models get slower, not faster, from more on a busy machine."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="module", params=sorted(tinymodel.tiny_models(TEXT_TO_VIDEO)))
def model_name(request: pytest.FixtureRequest) -> str:
    """Each tiny text-to-video model in turn: every test using it runs once per family."""
    return str(request.param)


@pytest.fixture(scope="module")
def pipeline_class(model_name: str) -> str:
    """The diffusers pipeline class of the model under test."""
    return tinymodel.TINY_MODELS[model_name]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory, model_name: str, pipeline_class: str) -> Path:
    """The tiny model, built once per family."""
    return tinymodel.build_tiny_pipeline(
        tmp_path_factory.mktemp("models") / model_name, seed=0, pipeline=pipeline_class
    )


@pytest.fixture(scope="module")
def video_pipeline(model_dir: Path, model_name: str, pipeline_class: str) -> VideoPipeline:
    """The tiny model loaded on CPU in float32."""
    return VideoPipeline.load(model_name, model_dir, "cpu", torch.float32, LoadOptions(pipeline=pipeline_class))


def test_saved_folder_is_a_loadable_pipeline_of_its_family(
    model_dir: Path, video_pipeline: VideoPipeline, model_name: str, pipeline_class: str
) -> None:
    assert (model_dir / "model_index.json").is_file()
    assert type(video_pipeline.pipe).__name__ == pipeline_class
    assert video_pipeline.model_id == model_name


def test_the_family_rules_cover_what_the_networks_need(video_pipeline: VideoPipeline, pipeline_class: str) -> None:
    spec = tinymodel.tiny_spec(pipeline_class, Path("unused"))
    assert video_pipeline.needs.size_multiple > 1 and video_pipeline.needs.frame_step > 1
    assert video_pipeline.needs.violations(spec) == []
    assert video_pipeline.needs.violations(spec.model_copy(update={"size_multiple": 8, "frame_step": 2})) != []


def test_plain_from_pretrained_loads_it_when_accelerate_is_installed(model_dir: Path, pipeline_class: str) -> None:
    pytest.importorskip("accelerate")
    from diffusers import DiffusionPipeline

    assert type(DiffusionPipeline.from_pretrained(model_dir, local_files_only=True)).__name__ == pipeline_class


def test_build_is_deterministic_and_cli_skips_existing(model_dir: Path, tmp_path: Path, pipeline_class: str) -> None:
    again = tinymodel.build_tiny_pipeline(tmp_path / "again", seed=0, pipeline=pipeline_class)
    built = sorted(p.relative_to(model_dir) for p in model_dir.rglob("*") if p.is_file())
    assert built == sorted(p.relative_to(again) for p in again.rglob("*") if p.is_file())
    for rel in built:
        assert (model_dir / rel).read_bytes() == (again / rel).read_bytes(), rel

    stamp = (again / "model_index.json").stat().st_mtime_ns
    assert tinymodel.main(["--out", str(again)]) == 0
    assert (again / "model_index.json").stat().st_mtime_ns == stamp


def test_generate_returns_a_decodable_mp4(video_pipeline: VideoPipeline) -> None:
    video = video_pipeline.generate(_request(), _no_steps, _never)
    assert isinstance(video, GeneratedVideo)
    assert video.content_type == "video/mp4"
    assert (video.num_frames, video.width, video.height, video.fps, video.seed) == (9, 32, 32, 8, 1)
    assert video.sha256 == hashlib.sha256(video.data).hexdigest()
    assert decode_mp4_info(video.data) == (9, 32, 32)


def test_every_size_the_family_allows_comes_out_exact(video_pipeline: VideoPipeline, pipeline_class: str) -> None:
    family = FAMILIES[pipeline_class]
    step, multiple = family.frame_step, family.size_multiple
    for frames, width, height in ((1, multiple, multiple), (1 + 2 * step, 2 * multiple, multiple)):
        video = video_pipeline.generate(_request(num_frames=frames, width=width, height=height), _no_steps, _never)
        assert decode_mp4_info(video.data) == (frames, width, height)


def test_same_seed_same_bytes_other_seed_other_bytes(video_pipeline: VideoPipeline) -> None:
    first = video_pipeline.generate(_request(seed=7), _no_steps, _never)
    second = video_pipeline.generate(_request(seed=7), _no_steps, _never)
    other = video_pipeline.generate(_request(seed=8), _no_steps, _never)
    assert first.sha256 == second.sha256
    assert first.sha256 != other.sha256


def test_missing_seed_is_derived_from_the_request(video_pipeline: VideoPipeline) -> None:
    assert _request(seed=None).resolved_seed() == _request(seed=None).resolved_seed()
    assert _request(seed=None).resolved_seed() != _request(seed=None, prompt="a dog").resolved_seed()
    first = video_pipeline.generate(_request(seed=None), _no_steps, _never)
    second = video_pipeline.generate(_request(seed=None), _no_steps, _never)
    assert first.seed == _request(seed=None).resolved_seed()
    assert first.sha256 == second.sha256


def test_on_step_reports_each_step(video_pipeline: VideoPipeline) -> None:
    steps: list[tuple[int, int]] = []
    video_pipeline.generate(_request(num_inference_steps=3), lambda done, total: steps.append((done, total)), _never)
    assert steps == [(1, 3), (2, 3), (3, 3)]


def test_abort_stops_after_the_step_and_pipeline_still_works(video_pipeline: VideoPipeline) -> None:
    baseline = video_pipeline.generate(_request(seed=3), _no_steps, _never)
    steps: list[int] = []
    with pytest.raises(RunAborted):
        video_pipeline.generate(
            _request(seed=3, num_inference_steps=4),
            lambda done, _total: steps.append(done),
            lambda: len(steps) >= 1,
        )
    assert steps == [1]
    again = video_pipeline.generate(_request(seed=3), _no_steps, _never)
    assert again.sha256 == baseline.sha256


def test_abort_before_start_runs_no_step(video_pipeline: VideoPipeline) -> None:
    steps: list[int] = []
    with pytest.raises(RunAborted):
        video_pipeline.generate(_request(), lambda done, _total: steps.append(done), lambda: True)
    assert steps == []


@pytest.mark.parametrize("changes", [{"width": 24}, {"width": 33}, {"num_frames": 0}, {"num_frames": 4}])
def test_bad_parameters_are_not_retryable(video_pipeline: VideoPipeline, changes: dict[str, object]) -> None:
    with pytest.raises(ValueError) as caught:
        video_pipeline.generate(_request(**changes), _no_steps, _never)
    assert classify(caught.value) == (False, "INVALID_PARAMETERS")


def test_warmup_runs(video_pipeline: VideoPipeline) -> None:
    assert video_pipeline.warmup() > 0


def test_encoding_is_byte_stable() -> None:
    # Smooth, low-contrast frames like the tiny model's are where x264's mbtree gave varying bytes.
    ramp = np.linspace(90, 160, 32, dtype=np.float64)
    frames = np.stack([(ramp[None, :, None] + ramp[:, None, None] * 0.1 * i) % 256 for i in range(9)])
    frames = np.repeat(frames, 3, axis=-1).astype(np.uint8)
    digests = {hashlib.sha256(encode_mp4(frames, 16)).hexdigest() for _ in range(20)}
    assert len(digests) == 1
    assert decode_mp4_info(encode_mp4(frames, 16)) == (9, 32, 32)


def test_encoding_rejects_odd_sizes() -> None:
    with pytest.raises(ValueError):
        encode_mp4(np.zeros((2, 31, 32, 3), np.uint8), 16)


def test_encoding_keeps_each_colour_in_bt709_limited_range() -> None:
    colours = [(128, 128, 128), (200, 30, 30), (30, 200, 30), (30, 30, 200), (16, 16, 16), (240, 240, 240)]
    frames = np.stack([np.full((32, 32, 3), colour, np.uint8) for colour in colours])
    with av.open(io.BytesIO(encode_mp4(frames, 8)), mode="r") as container:
        stream = container.streams.video[0]
        # tagged BT.709, MPEG range
        assert (stream.codec_context.colorspace, stream.codec_context.color_range) == (1, 1)
        decoded = [frame.to_ndarray(format="rgb24") for frame in container.decode(stream)]
    assert len(decoded) == len(colours)
    for frame, colour in zip(decoded, colours, strict=True):
        error = np.abs(frame.astype(np.int16) - np.array(colour, np.int16)).max()
        assert error <= 3, (colour, frame[16, 16])  # another matrix (BT.601) or full range would be off by 10 or more
    assert (decoded[0] == 128).all()  # grey stays grey: no tint from the chroma


def test_resolve_dtype() -> None:
    assert resolve_dtype("auto", "cpu") == torch.float32
    assert resolve_dtype("bfloat16", "cpu") == torch.bfloat16
    assert resolve_dtype("auto", "cuda:0") == pick_device()[1] or not torch.cuda.is_available()


def test_runtime_options_are_applied_and_the_video_is_unchanged(
    model_dir: Path, video_pipeline: VideoPipeline, model_name: str, pipeline_class: str
) -> None:
    baseline = video_pipeline.generate(_request(seed=5), _no_steps, _never)
    options = LoadOptions(
        pipeline=pipeline_class,
        vae_tiling=True,
        vae_slicing=True,
        offload="model",  # CUDA only: on CPU the pipeline simply stays where it is
        attention_backend="native" if FAMILIES[pipeline_class].attention_backends else None,
    )
    tuned = VideoPipeline.load(model_name, model_dir, "cpu", torch.float32, options)
    assert tuned.pipe.vae.use_tiling and tuned.pipe.vae.use_slicing
    steps: list[int] = []
    video = tuned.generate(_request(seed=5), lambda done, _total: steps.append(done), _never)
    assert steps == [1, 2] and video.sha256 == baseline.sha256


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["blocks", "transformer"])
def test_torch_compile_is_applied_and_warmed(tmp_path_factory: pytest.TempPathFactory, mode: str) -> None:
    folder = tinymodel.build_tiny_pipeline(tmp_path_factory.mktemp("compiled") / "wan-tiny")
    plain = VideoPipeline.load("wan-tiny", folder, "cpu", torch.float32)
    # 'eager' traces and guards like inductor, without minutes of kernel generation on a CPU.
    compiled = VideoPipeline.load(
        "wan-tiny", folder, "cpu", torch.float32, LoadOptions(torch_compile=mode, compile_backend="eager")
    )
    modules = [compiled.pipe.transformer] if mode == "transformer" else list(compiled.pipe.transformer.blocks)
    assert all(getattr(m, "_compiled_call_impl", None) is not None for m in modules)
    assert compiled.warmup(_request(num_inference_steps=1)) > 0 and compiled.warmup_seconds is not None
    assert (
        compiled.generate(_request(), _no_steps, _never).sha256 == plain.generate(_request(), _no_steps, _never).sha256
    )


@pytest.mark.parametrize(
    ("changes", "why"),
    [
        ({"pipeline": "SomeOtherPipeline"}, "the registry says SomeOtherPipeline"),
        ({"attention_backend": "no-such-backend"}, "no-such-backend"),
        ({"call_options": (("no_such_argument", 1),)}, "takes no no_such_argument"),
    ],
)
def test_options_the_pipeline_cannot_take_fail_the_load(model_dir: Path, changes: dict[str, object], why: str) -> None:
    with pytest.raises(ValueError, match=why):
        VideoPipeline.load("bad", model_dir, "cpu", torch.float32, LoadOptions(**changes))  # type: ignore[arg-type]


# One keyword argument of each family's __call__ that taskgate does not set itself and that changes the video.
EXTRA_OPTION: dict[str, tuple[str, object]] = {
    "WanPipeline": ("max_sequence_length", 8),
    "CogVideoXPipeline": ("use_dynamic_cfg", True),
    "LTXPipeline": ("guidance_rescale", 0.7),
    "HunyuanVideoPipeline": ("true_cfg_scale", 2.0),  # real CFG, so the negative prompt counts
}


def test_pipeline_options_reach_the_call(
    model_dir: Path, video_pipeline: VideoPipeline, model_name: str, pipeline_class: str
) -> None:
    option = EXTRA_OPTION[pipeline_class]
    tuned = VideoPipeline.load(model_name, model_dir, "cpu", torch.float32, LoadOptions(call_options=(option,)))
    assert tuned.call_options == dict([option])
    baseline = video_pipeline.generate(_request(), _no_steps, _never)
    video = tuned.generate(_request(), _no_steps, _never)
    assert decode_mp4_info(video.data) == decode_mp4_info(baseline.data) and video.sha256 != baseline.sha256


def test_pick_device() -> None:
    device, dtype = pick_device()
    if torch.cuda.is_available():
        assert device == "cuda" and dtype in (torch.bfloat16, torch.float16)
    else:
        assert (device, dtype) == ("cpu", torch.float32)


@pytest.mark.parametrize(
    ("exc", "expected"),
    [
        (torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"), (True, "CUDA_OOM")),
        (torch.cuda.OutOfMemoryError("allocation failed"), (True, "CUDA_OOM")),
        (RuntimeError("CUDA error: out of memory"), (True, "CUDA_OOM")),
        (OSError("disk went away"), (True, "TRANSIENT_IO")),
        (FileNotFoundError("model_index.json"), (True, "TRANSIENT_IO")),
        (ConnectionError("reset"), (True, "TRANSIENT_IO")),
        (TimeoutError(), (True, "TRANSIENT_IO")),
        (ValueError("`height` and `width` have to be divisible by 16"), (False, "INVALID_PARAMETERS")),
        (TypeError("unexpected keyword"), (False, "INVALID_PARAMETERS")),
        (RuntimeError("mat1 and mat2 shapes cannot be multiplied"), (False, "PIPELINE_ERROR")),
        (KeyError("x"), (False, "PIPELINE_ERROR")),
        (RunAborted("stop"), (False, "ABORTED")),
    ],
)
def test_classify(exc: BaseException, expected: tuple[bool, str]) -> None:
    assert classify(exc) == expected


def test_a_run_records_its_phases_as_children_of_the_current_span(
    video_pipeline: VideoPipeline, monkeypatch: pytest.MonkeyPatch
) -> None:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from taskgate import tracing

    provider = TracerProvider()
    exporter = InMemorySpanExporter()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer("test")
    monkeypatch.setattr(tracing, "_tracer", tracer)  # tracing on, into memory, for this test only
    with tracer.start_as_current_span("attempt") as attempt:
        video_pipeline.generate(_request(), _no_steps, _never)
    spans = {s.name: s for s in exporter.get_finished_spans()}
    phases = [spans[name] for name in ("load", "denoise", "decode", "encode")]
    assert all(s.parent is not None and s.parent.span_id == attempt.get_span_context().span_id for s in phases)
    times = [t or 0 for s in phases for t in (s.start_time, s.end_time)]
    assert 0 not in times and times == sorted(times), "the phases follow each other"
    assert phases[1].attributes is not None and phases[1].attributes["taskgate.steps"] == 2


def _gpu_check() -> Any:
    """scripts/gpu_check.py as a module (the scripts folder is not a package)."""
    path = ROOT / "scripts" / "gpu_check.py"
    spec = importlib.util.spec_from_file_location("gpu_check", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_gpu_check_skips_without_a_gpu_and_measures_on_the_cpu_when_told(capsys: pytest.CaptureFixture[str]) -> None:
    gpu_check = _gpu_check()
    if not torch.cuda.is_available():
        assert gpu_check.main([]) == 0
        assert "SKIP: no CUDA device" in capsys.readouterr().out
    small = ["--frames", "9", "--size", "32", "--steps", "2", "--runs", "2", "--busy-tasks", "2"]
    assert gpu_check.main(["--allow-cpu", "--models", "ltx-tiny", *small]) == 0
    summary = json.loads(next(line for line in capsys.readouterr().out.splitlines() if line.startswith("SUMMARY "))[8:])
    (ltx,) = summary["families"]
    assert ltx["pipeline"] == "LTXPipeline" and ltx["deterministic"] and 0 < ltx["device_busy"] <= 1
    assert len(ltx["seconds_per_step"]) == 2 and summary["failed"] == []


def test_pickled_weights_load_only_when_the_entry_allows_them(model_dir: Path, model_name: str, tmp_path: Path) -> None:
    """A pickled checkpoint runs code as it loads: a folder whose transformer is a .bin is refused unless opted in."""
    from safetensors.torch import load_file

    folder = tmp_path / "pickled"
    shutil.copytree(model_dir, folder)
    [weights] = (folder / "transformer").glob("*.safetensors")
    saved = load_file(weights)
    torch.save(saved, weights.with_suffix(".bin"))
    weights.unlink()
    with pytest.raises(OSError, match="safetensors"):
        VideoPipeline.load(model_name, folder, "cpu", torch.float32)
    allowed = VideoPipeline.load(model_name, folder, "cpu", torch.float32, LoadOptions(pickle_weights=True))
    loaded = allowed.pipe.transformer.state_dict()
    assert all(torch.equal(loaded[name], tensor) for name, tensor in saved.items())
