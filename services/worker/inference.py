"""Text- and image-to-video inference: runs a loaded diffusers pipeline with progress and abort hooks (loading and
placing it is services/worker/pipeload.py; the MP4 encoding of its frames is services/worker/encoding.py)."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import inspect
import json
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

from taskgate import tracing

from . import checkpoint, partial
from .encoding import CONTENT_TYPE_MP4, encode_mp4
from .pipeload import LoadOptions as LoadOptions  # LoadOptions, PipelineNeeds, pick_device, resolve_dtype: imported
from .pipeload import PipelineNeeds as PipelineNeeds  # from here by the runner, the tests and scripts/
from .pipeload import _first_int, _load_diffusion_pipeline, _place, _quiet_libraries, pipeline_needs
from .pipeload import pick_device as pick_device
from .pipeload import resolve_dtype as resolve_dtype
from .runtypes import RunAborted


@dataclass(frozen=True)
class GenerationRequest:
    """What to generate: the inputs of one run; `image` (RGB, already fitted to width x height) for an image-to-video
    pipeline, which requires one, and None for a text-to-video one, which takes none."""

    prompt: str
    negative_prompt: str = ""
    num_frames: int = 17
    width: int = 64
    height: int = 64
    num_inference_steps: int = 8
    guidance_scale: float = 5.0
    fps: int = 16
    seed: int | None = None
    image: Image.Image | None = field(default=None, hash=False)  # PIL images are unhashable; equality still counts

    def resolved_seed(self) -> int:
        """The given seed, or one derived from the other fields (the image by its pixels) so equal requests give equal
        videos."""
        if self.seed is not None:
            return self.seed
        values: dict[str, Any] = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        del values["seed"], values["image"]
        if self.image is not None:  # only then: a text request's derived seed stays what it always was
            values["image"] = _image_digest(self.image)
        digest = hashlib.sha256(json.dumps(values, sort_keys=True).encode()).digest()
        return int.from_bytes(digest[:8], "big") >> 1


def _image_digest(image: Image.Image) -> str:
    """The sha256 of an image's mode, size and pixels."""
    digest = hashlib.sha256(f"{image.mode} {image.width}x{image.height}\n".encode())
    digest.update(image.tobytes())
    return digest.hexdigest()


@dataclass(frozen=True)
class RenderedVideo:
    """One request's decoded frames (FxHxWx3 uint8, in host memory), not yet encoded."""

    frames: np.ndarray
    fps: int
    seed: int
    resumed_from: int = 0  # the step a checkpoint let this run start at (0: it ran every step)
    phases: dict[str, float] = field(default_factory=dict, compare=False)  # seconds of each phase of the device call


@dataclass(frozen=True)
class GeneratedVideo:
    """One encoded result video and what it holds."""

    data: bytes
    sha256: str
    num_frames: int
    width: int
    height: int
    fps: int
    seed: int
    content_type: str = CONTENT_TYPE_MP4


def _to_uint8_frames(output: Any) -> np.ndarray:
    """The first video of a pipeline's output_type="np" result, as FxHxWx3 uint8."""
    video = output.frames if hasattr(output, "frames") else output[0]
    if isinstance(video, list | tuple):
        video = video[0]
    if isinstance(video, torch.Tensor):
        video = video.detach().float().cpu().numpy()
    array = np.asarray(video)
    if array.ndim == 5:
        array = array[0]
    if array.ndim != 4:
        raise ValueError(f"unexpected video output shape {array.shape}")
    if array.shape[-1] not in (1, 3) and array.shape[1] in (1, 3):
        array = array.transpose(0, 2, 3, 1)
    if array.shape[-1] == 1:
        array = np.repeat(array, 3, axis=-1)
    if array.dtype != np.uint8:
        array = (np.clip(array.astype(np.float32), 0.0, 1.0) * 255.0).round().astype(np.uint8)
    return np.ascontiguousarray(array)


class VideoPipeline:
    """A loaded text- or image-to-video pipeline that turns GenerationRequests into MP4 videos, one run at a time."""

    def __init__(
        self,
        model_id: str,
        pipe: Any,
        device: str | torch.device,
        dtype: torch.dtype,
        call_options: dict[str, Any] | None = None,
    ) -> None:
        self.model_id = model_id
        self.pipe = pipe
        self.call_options = dict(call_options or {})
        self.warmup_seconds: float | None = None  # set by warmup(): the worker reports ready only after it
        self.needs = pipeline_needs(pipe)
        self.device = torch.device(device)
        self.dtype = dtype
        self._lock = threading.Lock()
        self._call_params = inspect.signature(pipe.__call__).parameters
        self._accepts_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in self._call_params.values())
        self._marks: dict[str, int] = {}  # when the current run's denoising loop began and ended (time.time_ns())
        self.preview_layout = partial.layout_of(type(pipe).__name__)
        spatial = _first_int(
            getattr(pipe, "vae_scale_factor_spatial", None), getattr(pipe, "vae_spatial_compression_ratio", None)
        )
        self._spatial = spatial or 8  # the latents' downscale, which a preview of packed latents needs
        bar = getattr(pipe, "progress_bar", None)
        if callable(bar):
            pipe.progress_bar = self._timed(bar)

    @classmethod
    def load(
        cls,
        model_id: str,
        folder: Path,
        device: str | torch.device,
        dtype: torch.dtype,
        options: LoadOptions | None = None,
    ) -> VideoPipeline:
        """Load a saved diffusers pipeline from a local folder onto a device with its runtime options, quietly."""
        _quiet_libraries()
        options = options or LoadOptions()
        loaded = _load_diffusion_pipeline(Path(folder), dtype, options.pipeline, pickle_weights=options.pickle_weights)
        pipe = _place(loaded, torch.device(device), options)
        if hasattr(pipe, "set_progress_bar_config"):
            pipe.set_progress_bar_config(disable=True)
        return cls(model_id, pipe, device, dtype, call_options=dict(options.call_options))

    @property
    def takes_image(self) -> bool:
        """Whether the pipeline is an image-to-video one: its __call__ names `image` (and then needs one)."""
        return "image" in self._call_params

    def warmup(self, request: GenerationRequest | None = None) -> float:
        """Run one small generation end to end (kernels, encoder) and return its seconds; an image pipeline gets a
        blank image of the warm-up size."""
        multiple = self.needs.size_multiple or 16
        size = multiple * -(-32 // multiple)  # the smallest multiple of at least 32 px
        frames = 1 + max(self.needs.frame_step, 4)
        req = request or GenerationRequest(
            prompt="warmup", num_frames=frames, width=size, height=size, num_inference_steps=1, seed=0
        )
        if self.takes_image and req.image is None:
            req = dataclasses.replace(req, image=Image.new("RGB", (req.width, req.height)))
        started = time.perf_counter()
        self.generate(req, on_step=lambda _step, _total: None, should_abort=lambda: False)
        self.warmup_seconds = time.perf_counter() - started
        return self.warmup_seconds

    def _timed(self, bar: Callable[..., Any]) -> Callable[..., Any]:
        """The pipeline's progress bar, also noting when its denoising loop begins and ends (the one hook every
        diffusers video pipeline has around that loop alone: the text encoder runs before it, the VAE after)."""
        marks = self._marks

        @contextlib.contextmanager
        def timed_bar(iterable: Any = None, total: int | None = None) -> Iterator[Any]:
            marks["denoise"] = time.time_ns()
            with bar(iterable=iterable, total=total) as inner:
                yield inner
            marks["decode"] = time.time_ns()

        def progress_bar(iterable: Any = None, total: int | None = None) -> Any:
            # a pipeline that iterates the bar directly, not as a context manager, gets it untouched
            return bar(iterable=iterable) if iterable is not None else timed_bar(total=total)

        return progress_bar

    def _accepts(self, name: str) -> bool:
        """Whether the pipeline's __call__ takes this keyword."""
        return self._accepts_any or name in self._call_params

    def generate(
        self,
        req: GenerationRequest,
        on_step: Callable[[int, int], None],
        should_abort: Callable[[], bool],
    ) -> GeneratedVideo:
        """Run one request to an MP4 (render, then encode); on_step(done, total) after each step; raises
        RunAborted when should_abort()."""
        return self.encode(self.render(req, on_step, should_abort))

    @property
    def not_resumable(self) -> str | None:
        """Why a run of this pipeline cannot resume from a step checkpoint (None: it can)."""
        return checkpoint.not_resumable(self.pipe, None if self._accepts_any else set(self._call_params))

    def fingerprint(self, req: GenerationRequest) -> str:
        """What a checkpoint must match to be resumed by this request on this pipeline: the request (its image by its
        pixels, its seed resolved), the model, the pipeline and scheduler, the dtype, the device kind and the versions
        of the libraries that compute the steps."""
        import diffusers

        values: dict[str, Any] = {f.name: getattr(req, f.name) for f in dataclasses.fields(req)}
        values["image"] = None if req.image is None else _image_digest(req.image)
        values["seed"] = req.resolved_seed()
        scheduler = getattr(self.pipe, "scheduler", None)
        values["model"] = [
            self.model_id,
            type(self.pipe).__name__,
            type(scheduler).__name__,
            str(self.dtype),
            self.device.type,
        ]
        values["scheduler_config"] = dict(getattr(scheduler, "config", {}) or {})
        values["versions"] = [diffusers.__version__, torch.__version__]
        values["call_options"] = sorted(self.call_options)
        encoded = json.dumps(values, sort_keys=True, default=str).encode()
        return hashlib.sha256(encoded).hexdigest()

    def render(
        self,
        req: GenerationRequest,
        on_step: Callable[[int, int], None],
        should_abort: Callable[[], bool],
        *,
        resume: checkpoint.Snapshot | None = None,
        capture: checkpoint.Capture | None = None,
        preview: partial.Partial | None = None,
    ) -> RenderedVideo:
        """The device phase of one request (prompt encoding, denoising, VAE decode) to frames in host memory; from
        `resume`'s step when it is a checkpoint of this very request, taking snapshots when `capture` says so and
        preview frames when `preview` says so."""
        if req.width < 2 or req.height < 2 or req.width % 2 or req.height % 2:
            raise ValueError(f"width and height must be even and >= 2, got {req.width}x{req.height}")
        if req.num_frames < 1 or req.num_inference_steps < 1 or req.fps < 1:
            raise ValueError("num_frames, num_inference_steps and fps must be >= 1")
        multiple, step = self.needs.size_multiple, self.needs.frame_step
        if multiple and (req.width % multiple or req.height % multiple):
            raise ValueError(f"width and height must be multiples of {multiple}, got {req.width}x{req.height}")
        if step and (req.num_frames - 1) % step:
            raise ValueError(f"num_frames - 1 must be a multiple of {step}, got {req.num_frames}")
        self._check_image(req)
        if should_abort():
            raise RunAborted("aborted before the first step")
        began = time.time_ns()

        seed = req.resolved_seed()
        steps = req.num_inference_steps
        generator = torch.Generator("cpu").manual_seed(seed)
        resumable = self.not_resumable is None
        fingerprint = self.fingerprint(req) if resumable and (resume is not None or capture is not None) else ""
        start = 0
        if resume is not None and resumable and resume.fingerprint == fingerprint and 0 < resume.step < steps:
            start = resume.step
            generator.set_state(resume.tensors[checkpoint.GENERATOR])
        if not resumable:
            capture = None

        def total_steps(pipe: Any) -> int:
            # Some schedulers run more timesteps than requested steps; the pipeline knows the real count.
            count = getattr(pipe, "num_timesteps", None)
            return count if isinstance(count, int) and count > 0 else steps

        def total_steps_from(pipe: Any) -> int:
            return start + total_steps(pipe) if start else total_steps(pipe)

        def snapshot_if_due(done: int, total: int, latents: Any) -> None:
            if capture is not None and capture.due(done, total):
                capture.keep(checkpoint.Snapshot(done, total, fingerprint, {
                    checkpoint.LATENTS: latents.detach().to("cpu", copy=True),
                    checkpoint.GENERATOR: generator.get_state(),
                }))

        grid = (
            (req.num_frames - 1) // (self.needs.frame_step or 1) + 1,
            req.height // self._spatial,
            req.width // self._spatial,
        )

        def after_step(pipe: Any, step: int, _timestep: Any, callback_kwargs: dict[str, Any]) -> dict[str, Any]:
            done, total = start + step + 1, total_steps_from(pipe)
            # taken before progress is told: a test that kills the worker after step k finds step k's snapshot kept
            snapshot_if_due(done, total, callback_kwargs["latents"])
            if preview is not None and preview.due(done, total):
                preview.take(done, callback_kwargs["latents"], grid, (req.width, req.height))
            on_step(done, total)
            if should_abort():
                # a drain asks for a snapshot before it sets the abort flag: one at the step it stops at, if not yet
                snapshot_if_due(done, total, callback_kwargs["latents"])
                raise RunAborted(f"aborted after step {done}")
            return callback_kwargs

        def legacy_step(step: int, _timestep: Any, _latents: Any) -> None:
            on_step(step + 1, steps)
            if should_abort():
                raise RunAborted(f"aborted after step {step + 1}")

        wanted: dict[str, Any] = {
            "prompt": req.prompt,
            "negative_prompt": req.negative_prompt,
            "num_frames": req.num_frames,
            "height": req.height,
            "width": req.width,
            "num_inference_steps": steps,
            "guidance_scale": req.guidance_scale,
            "frame_rate": req.fps,  # LTX-Video conditions on it
            "generator": generator,
            "output_type": "np",
        }
        kwargs = {k: v for k, v in wanted.items() if self._accepts(k)} | self.call_options
        if req.image is not None:  # only an image pipeline gets here with one (_check_image)
            kwargs["image"] = req.image
        if start:
            kwargs["latents"] = resume.tensors[checkpoint.LATENTS].to(self.device) if resume is not None else None
        if self._accepts("callback_on_step_end"):
            kwargs["callback_on_step_end"] = after_step
        elif self._accepts("callback"):
            kwargs["callback"] = legacy_step
            if self._accepts("callback_steps"):
                kwargs["callback_steps"] = 1

        with self._lock:
            self._marks.clear()
            try:
                with _schedule_from(getattr(self.pipe, "scheduler", None), start):
                    output = self.pipe(**kwargs)
            finally:
                returned = time.time_ns()
                phases = _phases(began, dict(self._marks), returned, steps - start)
        return RenderedVideo(_to_uint8_frames(output), req.fps, seed, start, phases)

    def _check_image(self, req: GenerationRequest) -> None:
        """ValueError unless the request carries an image exactly when the pipeline takes one, of the request's size."""
        name = type(self.pipe).__name__
        if req.image is None:
            if self.takes_image:
                raise ValueError(f"{name} makes a video from an image, and the request has none")
            return
        if not self.takes_image:
            raise ValueError(f"{name} makes a video from text alone: it takes no image")
        if req.image.size != (req.width, req.height):
            raise ValueError(
                f"the image is {req.image.width}x{req.image.height}; it must be fitted to {req.width}x{req.height}"
            )

    def encode(self, video: RenderedVideo) -> GeneratedVideo:
        """The CPU phase: rendered frames as an MP4 (needs no device: it overlaps the next request's render)."""
        began = time.time_ns()
        data = encode_mp4(video.frames, video.fps)
        tracing.phase("encode", start_ns=began, end_ns=time.time_ns(), attributes={"taskgate.bytes": len(data)})
        count, height, width, _ = video.frames.shape
        return GeneratedVideo(
            data=data,
            sha256=hashlib.sha256(data).hexdigest(),
            num_frames=count,
            width=width,
            height=height,
            fps=video.fps,
            seed=video.seed,
        )


@contextlib.contextmanager
def _schedule_from(scheduler: Any, start: int) -> Iterator[None]:
    """For one pipeline call, the scheduler's schedule as the pipeline sets it, less its first `start` timesteps, with
    its step index at `start` (pipelines set the index to 0 once the schedule is made): the call then runs exactly
    the uninterrupted run's steps from `start` on. Restored afterwards (a VideoPipeline runs one call at a time)."""
    if not start or scheduler is None:
        yield
        return
    set_timesteps = scheduler.set_timesteps
    set_begin_index = getattr(scheduler, "set_begin_index", None)

    @functools.wraps(set_timesteps)  # pipelines inspect its signature for `sigmas`, `mu`, `timesteps`
    def shifted_timesteps(*args: Any, **kwargs: Any) -> None:
        set_timesteps(*args, **kwargs)
        scheduler.timesteps = scheduler.timesteps[start:]
        if set_begin_index is not None:
            set_begin_index(start)

    def shifted_begin_index(begin_index: int = 0) -> None:
        assert set_begin_index is not None
        set_begin_index(begin_index + start)

    scheduler.set_timesteps = shifted_timesteps
    if set_begin_index is not None:
        scheduler.set_begin_index = shifted_begin_index
    try:
        yield
    finally:
        del scheduler.set_timesteps  # the instance attributes go; the class's methods show through again
        if set_begin_index is not None:
            del scheduler.set_begin_index


def _phases(began: int, marks: dict[str, int], returned: int, steps: int) -> dict[str, float]:
    """One span per phase of a pipeline call, children of the current (the attempt's): load (the pipeline taken, the
    prompt encoded, the latents prepared), denoise (the loop), decode (the VAE); one denoise span when the pipeline
    gave no marks. A run stopped part way gets the phases it began. Answers each phase's seconds."""
    attributes = {"taskgate.steps": steps}
    start, end = marks.get("denoise"), marks.get("decode")
    if start is None:
        tracing.phase("denoise", start_ns=began, end_ns=returned, attributes=attributes)
        return {"denoise": (returned - began) / 1e9}
    tracing.phase("load", start_ns=began, end_ns=start)
    tracing.phase("denoise", start_ns=start, end_ns=end or returned, attributes=attributes)
    seconds = {"load": (start - began) / 1e9, "denoise": ((end or returned) - start) / 1e9}
    if end is not None:
        tracing.phase("decode", start_ns=end, end_ns=returned)
        seconds["decode"] = (returned - end) / 1e9
    return seconds
