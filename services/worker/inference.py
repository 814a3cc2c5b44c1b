"""Text- and image-to-video inference: loads a diffusers pipeline and runs it with progress and abort hooks (the MP4
encoding of its frames is services/worker/encoding.py)."""

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

from taskgate import families, tracing
from taskgate.config import ModelSpec

from . import checkpoint, partial
from .encoding import CONTENT_TYPE_MP4, encode_mp4
from .runtypes import RunAborted

_MISSING = object()


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


def pick_device() -> tuple[str, torch.dtype]:
    """The device and dtype to run on: CUDA in bfloat16 (float16 without bf16 support), else CPU in float32."""
    if torch.cuda.is_available():
        return "cuda", torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return "cpu", torch.float32


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


def _quiet_libraries() -> None:
    """Silence diffusers/transformers logs and progress bars, which would flood worker logs."""
    from diffusers.utils import logging as diffusers_logging
    from transformers.utils import logging as transformers_logging

    diffusers_logging.set_verbosity_error()
    diffusers_logging.disable_progress_bar()
    transformers_logging.set_verbosity_error()
    transformers_logging.disable_progress_bar()


def _fp32_pinned_components(folder: Path) -> dict[str, tuple[type, list[str]]]:
    """Diffusers model components of a saved pipeline whose class keeps some weights in float32."""
    import diffusers

    index = json.loads((folder / "model_index.json").read_text())
    pinned: dict[str, tuple[type, list[str]]] = {}
    for name, spec in index.items():
        if name.startswith("_") or not isinstance(spec, list) or len(spec) != 2 or spec[0] != "diffusers":
            continue
        cls = getattr(diffusers, str(spec[1]), None)
        keep = getattr(cls, "_keep_in_fp32_modules", None) if isinstance(cls, type) else None
        if isinstance(cls, type) and keep:
            pinned[name] = (cls, [keep] if isinstance(keep, str) else list(keep))
    return pinned


@contextlib.contextmanager
def _fp32_pins_lifted(classes: list[type]) -> Iterator[None]:
    """Temporarily clear `_keep_in_fp32_modules` on model classes (not thread-safe; loading only)."""
    saved = [(cls, cls.__dict__.get("_keep_in_fp32_modules", _MISSING)) for cls in classes]
    try:
        for cls, _ in saved:
            cls._keep_in_fp32_modules = None  # type: ignore[attr-defined]
        yield
    finally:
        for cls, value in saved:
            if value is _MISSING:
                delattr(cls, "_keep_in_fp32_modules")
            else:
                cls._keep_in_fp32_modules = value  # type: ignore[attr-defined]


def _pipeline_class(folder: Path, wanted: str | None) -> Any:
    """The diffusers class to load `folder` with: the registry's when it names one the folder can be loaded as (the
    class model_index.json names, or one its family loads from), else DiffusionPipeline (the folder's own class)."""
    import diffusers

    if wanted is None:
        return diffusers.DiffusionPipeline
    saved = json.loads((folder / "model_index.json").read_text()).get("_class_name")
    family = families.family_of(wanted)
    if saved != wanted and (family is None or saved not in family.loads_from):
        raise ValueError(f"the folder holds a {saved}, the registry says {wanted}")
    cls = getattr(diffusers, wanted, None)
    if cls is None:
        raise ValueError(f"diffusers {diffusers.__version__} has no {wanted}")
    return cls


def _load_diffusion_pipeline(
    folder: Path, dtype: torch.dtype, pipeline: str | None = None, *, pickle_weights: bool = False
) -> Any:
    """`pipeline`'s (or the folder's own class's) from_pretrained from a local folder, with or without `accelerate`;
    safetensors weights only unless `pickle_weights` (a pickled checkpoint runs code when it is loaded)."""
    from diffusers.utils.import_utils import is_accelerate_available

    loader = _pipeline_class(folder, pipeline)
    # None lets diffusers take safetensors where present and fall back to pickles; True refuses the pickles
    kw: dict[str, Any] = {"dtype": dtype, "local_files_only": True, "use_safetensors": None if pickle_weights else True}
    if is_accelerate_available():
        return loader.from_pretrained(folder, **kw)
    # Without accelerate, diffusers 0.42 cannot load a model that pins modules to float32 (Wan's transformer
    # does): it refuses low_cpu_mem_usage=False for it and needs accelerate for True. Passing such a model in
    # pre-loaded does not help either: Wan lists its transformer as optional and loads it again regardless.
    # So load with the pins lifted, then put the pinned tensors back to float32 from the saved weights.
    pinned = _fp32_pinned_components(folder)
    with _fp32_pins_lifted([cls for cls, _ in pinned.values()]):
        pipe = loader.from_pretrained(folder, **kw, low_cpu_mem_usage=False)
    if dtype != torch.float32:
        for name, (_, keep) in pinned.items():
            module = getattr(pipe, name, None)
            if isinstance(module, torch.nn.Module):
                _restore_fp32_tensors(module, folder / name, keep)
    return pipe


def _restore_fp32_tensors(module: torch.nn.Module, subfolder: Path, keep: list[str]) -> None:
    """Make a model's pinned tensors float32 again, re-reading saved values the dtype cast rounded."""
    from safetensors import safe_open

    pinned = {
        name: tensor
        for name, tensor in [*module.named_parameters(), *module.named_buffers()]
        if tensor.is_floating_point() and any(k in name.split(".") for k in keep)
    }
    for tensor in pinned.values():
        tensor.data = tensor.data.to(torch.float32)
    index = subfolder / "diffusion_pytorch_model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = ["diffusion_pytorch_model.safetensors"]
    for file in files:
        if not (subfolder / file).is_file():
            continue
        with safe_open(str(subfolder / file), framework="pt") as weights:
            for key in weights.keys():  # noqa: SIM118 - safe_open is not a mapping
                if key in pinned:
                    pinned[key].data = weights.get_tensor(key).to(device=pinned[key].device, dtype=torch.float32)


_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def resolve_dtype(name: str, device: str | torch.device) -> torch.dtype:
    """A ModelSpec dtype on a device: 'auto' is pick_device's choice on CUDA and float32 elsewhere."""
    if name != "auto":
        return _DTYPES[name]
    return pick_device()[1] if torch.device(device).type == "cuda" else torch.float32


@dataclass(frozen=True)
class LoadOptions:
    """How a pipeline sits on its device (ModelSpec's runtime options); the defaults change nothing."""

    pipeline: str | None = None  # the class the registry expects the folder to hold
    offload: str = "none"  # "model" or "sequential": diffusers' CPU offload, CUDA only
    vae_tiling: bool = False
    vae_slicing: bool = False
    attention_backend: str | None = None
    torch_compile: str = "off"  # "transformer" or "blocks" (the transformer's repeated blocks)
    compile_mode: str | None = None
    compile_backend: str = "inductor"
    call_options: tuple[tuple[str, Any], ...] = ()
    pickle_weights: bool = False  # also load .bin/.pt weights (pickle can run code): only for folders you trust

    @classmethod
    def of(cls, spec: ModelSpec) -> LoadOptions:
        """The options of a registry entry."""
        return cls(
            pipeline=spec.pipeline,
            offload=spec.offload,
            vae_tiling=spec.vae_tiling,
            vae_slicing=spec.vae_slicing,
            attention_backend=spec.attention_backend,
            torch_compile=spec.torch_compile,
            compile_mode=spec.compile_mode,
            compile_backend=spec.compile_backend,
            call_options=tuple(sorted(spec.pipeline_options.items())),
            pickle_weights=spec.allow_pickle_weights,
        )


@dataclass(frozen=True)
class PipelineNeeds:
    """What the loaded networks require of a request: sizes and num_frames - 1 multiples of these (0 = unknown)."""

    size_multiple: int
    frame_step: int

    def violations(self, spec: ModelSpec) -> list[str]:
        """The registry rules that would let through requests these networks cannot produce exactly."""
        found = []
        if self.size_multiple and spec.size_multiple % self.size_multiple:
            found.append(f"size_multiple {spec.size_multiple} is not a multiple of {self.size_multiple}")
        if self.frame_step and spec.frame_step % self.frame_step:
            found.append(f"frame_step {spec.frame_step} is not a multiple of {self.frame_step}")
        return found


def _first_int(*values: Any) -> int:
    """The first value that is a positive int, else 0."""
    return next((v for v in values if isinstance(v, int) and not isinstance(v, bool) and v > 0), 0)


def pipeline_needs(pipe: Any) -> PipelineNeeds:
    """The VAE's spatial factor times the transformer's patch, and the VAE's temporal factor, read from the pipeline."""
    config = getattr(getattr(pipe, "transformer", None), "config", None)
    patch = getattr(config, "patch_size", None)
    spatial_patch = patch[-1] if isinstance(patch, list | tuple) else patch
    spatial = _first_int(getattr(pipe, "vae_scale_factor_spatial", None), getattr(pipe, "vae_spatial_compression_ratio", None))
    temporal = _first_int(getattr(pipe, "vae_scale_factor_temporal", None), getattr(pipe, "vae_temporal_compression_ratio", None))
    patch_size = _first_int(getattr(pipe, "transformer_spatial_patch_size", None), spatial_patch) or 1
    return PipelineNeeds(size_multiple=spatial * patch_size, frame_step=temporal)


def _place(pipe: Any, device: torch.device, options: LoadOptions) -> Any:
    """Apply the runtime options and put the pipeline on its device; raises ValueError for options it cannot take."""
    name = type(pipe).__name__
    if options.pipeline is not None and name != options.pipeline:
        raise ValueError(f"the folder holds a {name}, the registry says {options.pipeline}")
    call_params = inspect.signature(pipe.__call__).parameters
    unknown = [k for k, _ in options.call_options if k not in call_params]
    if unknown:
        raise ValueError(f"{name} takes no {', '.join(unknown)} (pipeline_options)")
    transformer: Any = getattr(pipe, "transformer", None)
    if options.attention_backend is not None:
        if not hasattr(transformer, "set_attention_backend"):
            raise ValueError(f"{name} has no transformer with attention backends")
        transformer.set_attention_backend(options.attention_backend)
    vae = getattr(pipe, "vae", None)
    for wanted, method in ((options.vae_tiling, "enable_tiling"), (options.vae_slicing, "enable_slicing")):
        if wanted:
            if not callable(getattr(vae, method, None)):
                raise ValueError(f"the VAE of {name} has no {method}")
            getattr(vae, method)()
    if options.offload != "none" and device.type == "cuda":
        # Offload keeps weights on the CPU and moves them in per use; diffusers picks the device from gpu_id.
        offload = pipe.enable_model_cpu_offload if options.offload == "model" else pipe.enable_sequential_cpu_offload
        offload(device=device)
    else:
        pipe = pipe.to(device)
    if options.torch_compile != "off":
        if transformer is None:
            raise ValueError(f"{name} has no transformer to compile")
        compile_args: dict[str, Any] = {"backend": options.compile_backend}
        if options.compile_mode is not None:
            compile_args["mode"] = options.compile_mode
        if options.torch_compile == "blocks":
            transformer.compile_repeated_blocks(**compile_args)
        else:
            transformer.compile(**compile_args)
    return pipe


class VideoPipeline:
    """A loaded text- or image-to-video pipeline that turns GenerationRequests into MP4 videos, one run at a time."""

    def __init__(
        self, model_id: str, pipe: Any, device: str | torch.device, dtype: torch.dtype, call_options: dict[str, Any] | None = None
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
        spatial = _first_int(getattr(pipe, "vae_scale_factor_spatial", None), getattr(pipe, "vae_spatial_compression_ratio", None))
        self._spatial = spatial or 8  # the latents' downscale, which a preview of packed latents needs
        bar = getattr(pipe, "progress_bar", None)
        if callable(bar):
            pipe.progress_bar = self._timed(bar)

    @classmethod
    def load(
        cls, model_id: str, folder: Path, device: str | torch.device, dtype: torch.dtype, options: LoadOptions | None = None
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
        req = request or GenerationRequest(prompt="warmup", num_frames=frames, width=size, height=size, num_inference_steps=1, seed=0)
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
        values["model"] = [self.model_id, type(self.pipe).__name__, type(scheduler).__name__, str(self.dtype), self.device.type]
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

        grid = ((req.num_frames - 1) // (self.needs.frame_step or 1) + 1, req.height // self._spatial, req.width // self._spatial)

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
            raise ValueError(f"the image is {req.image.width}x{req.image.height}; it must be fitted to {req.width}x{req.height}")

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
