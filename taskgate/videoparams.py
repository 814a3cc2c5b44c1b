"""A video request's parameters resolved against its model's spec, in one place: what an unset parameter becomes and
which values the model refuses. The gateway resolves a request (SubmitTask) and checks it; the worker resolves the
stored request it runs; both through here.

An unset parameter is the model's default. On the wire (proto3 VideoParams) unset is 0 (the seed: absent), so the
gateway reads a 0 as the default; in a stored request (the task's payload, which the gateway writes with every value
filled in) unset is a missing key or null, and a stored value is taken as it is.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from taskgate.config import ModelSpec
from taskgate_api.v1 import task_pb2


@dataclass(frozen=True, slots=True)
class VideoParams:
    """A video request's parameters with every default filled in."""

    num_frames: int
    width: int
    height: int
    num_inference_steps: int
    guidance_scale: float
    fps: int
    seed: int | None
    negative_prompt: str

    def payload(self) -> dict[str, Any]:
        """The stored request's parameters (the task's payload): the guidance rounded to what the float32 on the wire
        meant (5.1, not 5.099999904632568), 0.0 when it is not a finite number."""
        return {
            "num_frames": self.num_frames,
            "width": self.width,
            "height": self.height,
            "num_inference_steps": self.num_inference_steps,
            "guidance_scale": round(self.guidance_scale, 4) if math.isfinite(self.guidance_scale) else 0.0,
            "fps": self.fps,
            "seed": self.seed,
            "negative_prompt": self.negative_prompt,
        }


def defaults(spec: ModelSpec, *, seed: int | None = None) -> VideoParams:
    """The model's defaults: a request that sets nothing."""
    return VideoParams(
        num_frames=spec.default_frames, width=spec.default_width, height=spec.default_height,
        num_inference_steps=spec.default_steps, guidance_scale=spec.default_guidance, fps=spec.default_fps, seed=seed,
        negative_prompt="",
    )


def _or_default(value: int, default: int) -> int:
    return default if value == 0 else value


def requested(p: task_pb2.VideoParams, spec: ModelSpec) -> VideoParams:
    """A SubmitTask request's parameters: each 0 (proto3's unset) is the model's default; the seed is None when
    absent."""
    return VideoParams(
        num_frames=_or_default(p.num_frames, spec.default_frames),
        width=_or_default(p.width, spec.default_width),
        height=_or_default(p.height, spec.default_height),
        num_inference_steps=_or_default(p.num_inference_steps, spec.default_steps),
        guidance_scale=float(p.guidance_scale) if p.guidance_scale != 0 else spec.default_guidance,
        fps=_or_default(p.fps, spec.default_fps),
        seed=int(p.seed) if p.HasField("seed") else None,
        negative_prompt=p.negative_prompt,
    )


def _stored(payload: Mapping[str, Any], name: str, default: Any) -> Any:
    value = payload.get(name)
    return default if value is None else value


def stored(payload: Mapping[str, Any], spec: ModelSpec) -> VideoParams:
    """A stored request's parameters: a missing or null one is the model's default, any other value is taken as it is
    (a 0 too: the gateway stored it so)."""
    seed = payload.get("seed")
    return VideoParams(
        num_frames=int(_stored(payload, "num_frames", spec.default_frames)),
        width=int(_stored(payload, "width", spec.default_width)),
        height=int(_stored(payload, "height", spec.default_height)),
        num_inference_steps=int(_stored(payload, "num_inference_steps", spec.default_steps)),
        guidance_scale=float(_stored(payload, "guidance_scale", spec.default_guidance)),
        fps=int(_stored(payload, "fps", spec.default_fps)),
        seed=None if seed is None else int(seed),
        negative_prompt=str(_stored(payload, "negative_prompt", "")),
    )


def violations(params: VideoParams, spec: ModelSpec, *, max_fps: int) -> list[tuple[str, str]]:
    """Each of the frame count, size, steps, guidance and frame rate the model refuses, as (field, why), in that order
    (the seed and the negative prompt are the gateway's own checks)."""
    bad = []
    frames = params.num_frames
    if frames < 1 or frames > spec.max_frames or (frames - 1) % spec.frame_step:
        bad.append(
            ("params.num_frames", f"must be 1..{spec.max_frames} with num_frames - 1 a multiple of {spec.frame_step}")
        )
    if params.width < 1 or params.width > spec.max_width or params.width % spec.size_multiple:
        bad.append(("params.width", f"must be a multiple of {spec.size_multiple} up to {spec.max_width}"))
    if params.height < 1 or params.height > spec.max_height or params.height % spec.size_multiple:
        bad.append(("params.height", f"must be a multiple of {spec.size_multiple} up to {spec.max_height}"))
    if params.num_inference_steps < 1 or params.num_inference_steps > spec.max_steps:
        bad.append(("params.num_inference_steps", f"must be 1..{spec.max_steps}"))
    guidance = params.guidance_scale
    if not math.isfinite(guidance) or guidance < 0 or guidance > spec.max_guidance:
        bad.append(("params.guidance_scale", f"must be 0..{spec.max_guidance}"))
    if params.fps < 1 or params.fps > max_fps:
        bad.append(("params.fps", f"must be 1..{max_fps}"))
    return bad
