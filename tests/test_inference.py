"""Tests for the inference layer against the tiny offline Wan pipeline."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np
import pytest
import torch

from services.worker.inference import (
    GeneratedVideo,
    GenerationRequest,
    InferenceAborted,
    VideoPipeline,
    classify,
    decode_mp4_info,
    encode_mp4,
    pick_device,
)
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


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model, built once for this module."""
    return tinymodel.build_tiny_pipeline(tmp_path_factory.mktemp("models") / "wan-tiny", seed=0)


@pytest.fixture(scope="module")
def video_pipeline(model_dir: Path) -> VideoPipeline:
    """The tiny model loaded on CPU in float32."""
    return VideoPipeline.load("wan-tiny", model_dir, "cpu", torch.float32)


def test_saved_folder_is_a_loadable_wan_pipeline(model_dir: Path, video_pipeline: VideoPipeline) -> None:
    from diffusers import WanPipeline

    assert (model_dir / "model_index.json").is_file()
    assert isinstance(video_pipeline.pipe, WanPipeline)
    assert video_pipeline.model_id == "wan-tiny"


def test_plain_from_pretrained_loads_it_when_accelerate_is_installed(model_dir: Path) -> None:
    pytest.importorskip("accelerate")
    from diffusers import DiffusionPipeline, WanPipeline

    assert isinstance(DiffusionPipeline.from_pretrained(model_dir, local_files_only=True), WanPipeline)


def test_build_is_deterministic_and_cli_skips_existing(model_dir: Path, tmp_path: Path) -> None:
    again = tinymodel.build_tiny_pipeline(tmp_path / "again", seed=0)
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
    with pytest.raises(InferenceAborted):
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
    with pytest.raises(InferenceAborted):
        video_pipeline.generate(_request(), lambda done, _total: steps.append(done), lambda: True)
    assert steps == []


@pytest.mark.parametrize("changes", [{"width": 24}, {"width": 33}, {"num_frames": 0}])
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
        (RuntimeError("CUDA error: out of memory"), (True, "CUDA_OOM")),
        (OSError("disk went away"), (True, "TRANSIENT_IO")),
        (FileNotFoundError("model_index.json"), (True, "TRANSIENT_IO")),
        (ConnectionError("reset"), (True, "TRANSIENT_IO")),
        (TimeoutError(), (True, "TRANSIENT_IO")),
        (ValueError("`height` and `width` have to be divisible by 16"), (False, "INVALID_PARAMETERS")),
        (TypeError("unexpected keyword"), (False, "INVALID_PARAMETERS")),
        (RuntimeError("mat1 and mat2 shapes cannot be multiplied"), (False, "PIPELINE_ERROR")),
        (KeyError("x"), (False, "PIPELINE_ERROR")),
        (InferenceAborted("stop"), (False, "ABORTED")),
    ],
)
def test_classify(exc: BaseException, expected: tuple[bool, str]) -> None:
    assert classify(exc) == expected
