"""Text-to-video inference: loads a diffusers pipeline, runs it with progress and abort hooks, encodes MP4."""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import inspect
import io
import json
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import av
import numpy as np
import torch

CONTENT_TYPE_MP4 = "video/mp4"

# x264 writes its settings (thread count included) into the stream, so a fixed count keeps bytes host-independent.
_X264_THREADS = 4
# mbtree off: with it, the bundled x264 (core 165, av 18.1.0) gave different bytes for identical input, run to run.
_X264_OPTIONS = {"preset": "medium", "crf": "18", "x264-params": "mbtree=0"}


def _fixed_point(value: float) -> int:
    """A coefficient scaled by 2**16 for integer colour conversion."""
    return round(value * 65536)


# BT.709 RGB -> limited-range YCbCr in 16.16 fixed point; integer maths gives the same bytes on every CPU,
# which swscale's SIMD paths do not promise. Chroma rows sum to zero so grey stays exactly 128.
_KR, _KB = 0.2126, 0.0722
_KG = 1.0 - _KR - _KB
_Y = (_fixed_point(219 / 255 * _KR), _fixed_point(219 / 255 * _KG), _fixed_point(219 / 255 * _KB))
_CB_R = _fixed_point(-224 / 255 * _KR / (2 * (1 - _KB)))
_CB_G = _fixed_point(-224 / 255 * _KG / (2 * (1 - _KB)))
_CB = (_CB_R, _CB_G, -(_CB_R + _CB_G))
_CR_G = _fixed_point(-224 / 255 * _KG / (2 * (1 - _KR)))
_CR_B = _fixed_point(-224 / 255 * _KB / (2 * (1 - _KR)))
_CR = (-(_CR_G + _CR_B), _CR_G, _CR_B)

_MISSING = object()


class InferenceAborted(Exception):
    """Raised inside a run when its caller asked to stop; the pipeline stays usable."""


@dataclass(frozen=True)
class GenerationRequest:
    """What to generate: the inputs of one text-to-video run."""

    prompt: str
    negative_prompt: str = ""
    num_frames: int = 17
    width: int = 64
    height: int = 64
    num_inference_steps: int = 8
    guidance_scale: float = 5.0
    fps: int = 16
    seed: int | None = None

    def resolved_seed(self) -> int:
        """The given seed, or one derived from the other fields so equal requests give equal videos."""
        if self.seed is not None:
            return self.seed
        fields = dataclasses.asdict(self)
        del fields["seed"]
        digest = hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).digest()
        return int.from_bytes(digest[:8], "big") >> 1


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


def classify(exc: BaseException) -> tuple[bool, str]:
    """(retryable, error_code) for an exception raised while loading or running a pipeline."""
    if isinstance(exc, InferenceAborted):
        return False, "ABORTED"
    if isinstance(exc, torch.cuda.OutOfMemoryError) or "out of memory" in str(exc).lower():
        return True, "CUDA_OOM"
    if isinstance(exc, OSError | ConnectionError | TimeoutError):
        return True, "TRANSIENT_IO"
    if isinstance(exc, ValueError | TypeError):
        return False, "INVALID_PARAMETERS"
    return False, "PIPELINE_ERROR"


def _rgb_to_yuv420p(frame: np.ndarray) -> np.ndarray:
    """One HxWx3 uint8 RGB frame as a yuv420p plane stack of shape (H*3/2, W)."""
    rgb = frame.astype(np.int32)
    r, g, b = rgb[..., 0], rgb[..., 1], rgb[..., 2]
    y = ((_Y[0] * r + _Y[1] * g + _Y[2] * b + (1 << 15)) >> 16) + 16
    # Each chroma sample comes from the sum of a 2x2 block, hence the two extra bits of shift.
    quad = rgb[0::2, 0::2] + rgb[1::2, 0::2] + rgb[0::2, 1::2] + rgb[1::2, 1::2]
    rs, gs, bs = quad[..., 0], quad[..., 1], quad[..., 2]
    u = ((_CB[0] * rs + _CB[1] * gs + _CB[2] * bs + (1 << 17)) >> 18) + 128
    v = ((_CR[0] * rs + _CR[1] * gs + _CR[2] * bs + (1 << 17)) >> 18) + 128
    height, width = y.shape
    chroma = np.concatenate([u.reshape(-1), v.reshape(-1)]).reshape(height // 2, width)
    return np.clip(np.concatenate([y, chroma], axis=0), 0, 255).astype(np.uint8)


def encode_mp4(frames: np.ndarray, fps: int) -> bytes:
    """H.264/yuv420p MP4 bytes for FxHxWx3 uint8 RGB frames; identical frames give identical bytes."""
    if frames.ndim != 4 or frames.shape[-1] != 3 or frames.dtype != np.uint8:
        raise ValueError(f"expected FxHxWx3 uint8 frames, got {frames.shape} {frames.dtype}")
    count, height, width, _ = frames.shape
    if count < 1 or height % 2 or width % 2:
        raise ValueError(f"H.264 yuv420p needs >= 1 frame and even sizes, got {count}x{width}x{height}")
    if fps < 1:
        raise ValueError(f"fps must be >= 1, got {fps}")
    buffer = io.BytesIO()
    with av.open(buffer, mode="w", format="mp4", options={"fflags": "+bitexact"}) as container:
        stream = container.add_stream("libx264", rate=fps)
        stream.width = width
        stream.height = height
        stream.pix_fmt = "yuv420p"
        ctx = stream.codec_context
        ctx.flags |= av.codec.context.Flags.bitexact
        ctx.thread_count = _X264_THREADS
        ctx.options = dict(_X264_OPTIONS)
        ctx.colorspace = 1  # BT.709
        ctx.color_primaries = 1
        ctx.color_trc = 1
        ctx.color_range = 1  # limited ("MPEG") range
        for index in range(count):
            frame = av.VideoFrame.from_ndarray(_rgb_to_yuv420p(frames[index]), format="yuv420p")
            frame.pts = index
            container.mux(stream.encode(frame))
        container.mux(stream.encode(None))
    return buffer.getvalue()


def decode_mp4_info(data: bytes) -> tuple[int, int, int]:
    """(frames, width, height) of an MP4, counted by decoding it."""
    with av.open(io.BytesIO(data), mode="r") as container:
        stream = container.streams.video[0]
        frames = sum(1 for _ in container.decode(stream))
        return frames, stream.codec_context.width, stream.codec_context.height


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


def _load_diffusion_pipeline(folder: Path, dtype: torch.dtype) -> Any:
    """DiffusionPipeline.from_pretrained from a local folder, working with or without `accelerate`."""
    from diffusers import DiffusionPipeline
    from diffusers.utils.import_utils import is_accelerate_available

    if is_accelerate_available():
        return DiffusionPipeline.from_pretrained(folder, dtype=dtype, local_files_only=True)
    # Without accelerate, diffusers 0.42 cannot load a model that pins modules to float32 (Wan's transformer
    # does): it refuses low_cpu_mem_usage=False for it and needs accelerate for True. Passing such a model in
    # pre-loaded does not help either: Wan lists its transformer as optional and loads it again regardless.
    # So load with the pins lifted, then put the pinned tensors back to float32 from the saved weights.
    pinned = _fp32_pinned_components(folder)
    with _fp32_pins_lifted([cls for cls, _ in pinned.values()]):
        pipe = DiffusionPipeline.from_pretrained(folder, dtype=dtype, local_files_only=True, low_cpu_mem_usage=False)
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


class VideoPipeline:
    """A loaded text-to-video pipeline that turns GenerationRequests into MP4 videos, one run at a time."""

    def __init__(self, model_id: str, pipe: Any, device: str | torch.device, dtype: torch.dtype) -> None:
        self.model_id = model_id
        self.pipe = pipe
        self.device = torch.device(device)
        self.dtype = dtype
        self._lock = threading.Lock()
        self._call_params = inspect.signature(pipe.__call__).parameters
        self._accepts_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in self._call_params.values())

    @classmethod
    def load(cls, model_id: str, folder: Path, device: str | torch.device, dtype: torch.dtype) -> VideoPipeline:
        """Load a saved diffusers pipeline from a local folder onto a device, quietly."""
        _quiet_libraries()
        pipe = _load_diffusion_pipeline(Path(folder), dtype)
        pipe = pipe.to(device)
        if hasattr(pipe, "set_progress_bar_config"):
            pipe.set_progress_bar_config(disable=True)
        return cls(model_id, pipe, device, dtype)

    def warmup(self, request: GenerationRequest | None = None) -> float:
        """Run one small generation end to end (kernels, encoder) and return its seconds."""
        req = request or GenerationRequest(prompt="warmup", num_frames=5, width=32, height=32, num_inference_steps=1, seed=0)
        started = time.perf_counter()
        self.generate(req, on_step=lambda _step, _total: None, should_abort=lambda: False)
        return time.perf_counter() - started

    def _accepts(self, name: str) -> bool:
        """Whether the pipeline's __call__ takes this keyword."""
        return self._accepts_any or name in self._call_params

    def generate(
        self,
        req: GenerationRequest,
        on_step: Callable[[int, int], None],
        should_abort: Callable[[], bool],
    ) -> GeneratedVideo:
        """Run one request; on_step(done, total) after each step; raises InferenceAborted when should_abort()."""
        if req.width < 2 or req.height < 2 or req.width % 2 or req.height % 2:
            raise ValueError(f"width and height must be even and >= 2, got {req.width}x{req.height}")
        if req.num_frames < 1 or req.num_inference_steps < 1 or req.fps < 1:
            raise ValueError("num_frames, num_inference_steps and fps must be >= 1")
        if should_abort():
            raise InferenceAborted("aborted before the first step")

        seed = req.resolved_seed()
        steps = req.num_inference_steps

        def total_steps(pipe: Any) -> int:
            # Some schedulers run more timesteps than requested steps; the pipeline knows the real count.
            count = getattr(pipe, "num_timesteps", None)
            return count if isinstance(count, int) and count > 0 else steps

        def after_step(pipe: Any, step: int, _timestep: Any, callback_kwargs: dict[str, Any]) -> dict[str, Any]:
            on_step(step + 1, total_steps(pipe))
            if should_abort():
                raise InferenceAborted(f"aborted after step {step + 1}")
            return callback_kwargs

        def legacy_step(step: int, _timestep: Any, _latents: Any) -> None:
            on_step(step + 1, steps)
            if should_abort():
                raise InferenceAborted(f"aborted after step {step + 1}")

        wanted: dict[str, Any] = {
            "prompt": req.prompt,
            "negative_prompt": req.negative_prompt,
            "num_frames": req.num_frames,
            "height": req.height,
            "width": req.width,
            "num_inference_steps": steps,
            "guidance_scale": req.guidance_scale,
            "generator": torch.Generator("cpu").manual_seed(seed),
            "output_type": "np",
        }
        kwargs = {k: v for k, v in wanted.items() if self._accepts(k)}
        if self._accepts("callback_on_step_end"):
            kwargs["callback_on_step_end"] = after_step
        elif self._accepts("callback"):
            kwargs["callback"] = legacy_step
            if self._accepts("callback_steps"):
                kwargs["callback_steps"] = 1

        with self._lock:
            output = self.pipe(**kwargs)
        frames = _to_uint8_frames(output)
        data = encode_mp4(frames, req.fps)
        count, height, width, _ = frames.shape
        return GeneratedVideo(
            data=data,
            sha256=hashlib.sha256(data).hexdigest(),
            num_frames=count,
            width=width,
            height=height,
            fps=req.fps,
            seed=seed,
        )
