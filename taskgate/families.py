"""Video model families: each diffusers text- or image-to-video pipeline class's request rules and defaults (pure
data, no torch)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Literal

TaskType = Literal["text-to-video", "image-to-video"]
TEXT_TO_VIDEO: TaskType = "text-to-video"
IMAGE_TO_VIDEO: TaskType = "image-to-video"  # the request carries an input image: the video's first frame


@dataclass(frozen=True, slots=True)
class Family:
    """What one diffusers video pipeline class accepts, and what a request gets when it gives nothing."""

    label: str
    frame_step: int  # num_frames - 1 must be a multiple of this (the VAE's temporal factor, or what decodes exactly)
    size_multiple: int  # width and height: the VAE's spatial factor times the transformer's patch size
    max_frames: int
    max_width: int
    max_height: int
    max_steps: int
    max_guidance: float
    default_frames: int
    default_width: int
    default_height: int
    default_steps: int
    default_guidance: float
    default_fps: int
    negative_prompt: bool  # whether the pipeline uses a negative prompt with its default options
    attention_backends: bool  # whether its attention honours diffusers' set_attention_backend (diffusers 0.42.1)
    repeated_blocks: bool  # whether its transformer declares blocks for regional torch.compile
    task_type: TaskType = TEXT_TO_VIDEO  # what its __call__ makes: image-to-video takes an `image` and requires one
    loads_from: tuple[str, ...] = ()  # other classes whose saved folders hold exactly this class's components

    def spec_defaults(self) -> dict[str, object]:
        """The ModelSpec fields this family fills when an entry leaves them out (task_types: the family's one type)."""
        values = asdict(self)
        for name in ("label", "attention_backends", "repeated_blocks", "task_type", "loads_from"):
            del values[name]
        values["task_types"] = [self.task_type]
        return values


FAMILIES: dict[str, Family] = {
    # Wan 2.1/2.2 (T2V 1.3B, 14B, A14B): VAE /8 spatial, /4 temporal, patch 2; 81 frames at 16 fps.
    # Wan 2.2 TI2V-5B uses a /16 VAE: register it with size_multiple 32.
    "WanPipeline": Family(
        label="Wan",
        frame_step=4,
        size_multiple=16,
        max_frames=81,
        max_width=1280,
        max_height=1280,
        max_steps=100,
        max_guidance=20.0,
        default_frames=81,
        default_width=832,
        default_height=480,
        default_steps=50,
        default_guidance=5.0,
        default_fps=16,
        negative_prompt=True,
        attention_backends=True,
        repeated_blocks=True,
    ),
    # CogVideoX 2B/5B (49 frames at 8 fps, 720x480) and 1.5 (81 frames, 1360x768: raise max_frames).
    # Its VAE decodes latent frames in pairs, so only an odd latent count gives back exactly the frames asked for.
    "CogVideoXPipeline": Family(
        label="CogVideoX",
        frame_step=8,
        size_multiple=16,
        max_frames=49,
        max_width=1360,
        max_height=1360,
        max_steps=100,
        max_guidance=20.0,
        default_frames=49,
        default_width=720,
        default_height=480,
        default_steps=50,
        default_guidance=6.0,
        default_fps=8,
        negative_prompt=True,
        attention_backends=False,
        repeated_blocks=False,
    ),
    # LTX-Video 0.9.x: VAE /32 spatial, /8 temporal, patch 1; up to 257 frames; conditions on the frame rate.
    "LTXPipeline": Family(
        label="LTX-Video",
        frame_step=8,
        size_multiple=32,
        max_frames=257,
        max_width=1280,
        max_height=1280,
        max_steps=100,
        max_guidance=20.0,
        default_frames=161,
        default_width=704,
        default_height=480,
        default_steps=50,
        default_guidance=3.0,
        default_fps=25,
        negative_prompt=True,
        attention_backends=True,
        repeated_blocks=True,
    ),
    # HunyuanVideo: VAE /8 spatial, /4 temporal, patch 2; guidance-distilled, so guidance_scale is the embedded
    # guidance and a negative prompt is ignored unless the model sets true_cfg_scale > 1 in pipeline_options.
    "HunyuanVideoPipeline": Family(
        label="HunyuanVideo",
        frame_step=4,
        size_multiple=16,
        max_frames=129,
        max_width=1280,
        max_height=1280,
        max_steps=100,
        max_guidance=20.0,
        default_frames=129,
        default_width=1280,
        default_height=720,
        default_steps=50,
        default_guidance=6.0,
        default_fps=24,
        negative_prompt=False,
        attention_backends=True,
        repeated_blocks=True,
    ),
    # Image-to-video: the same transformers and VAEs as the text classes above (so the same frame, size, attention and
    # compile rules); the input image, fitted to the request's size, is the video's first frame.
    # Wan 2.1 I2V 14B (480P/720P; with a CLIP image encoder) and Wan 2.2 I2V A14B: as WanPipeline, 81 frames at 16 fps.
    # Wan 2.2 TI2V-5B loads as this class too, with a /16 VAE: register it with size_multiple 32.
    "WanImageToVideoPipeline": Family(
        label="Wan I2V",
        frame_step=4,
        size_multiple=16,
        max_frames=81,
        max_width=1280,
        max_height=1280,
        max_steps=100,
        max_guidance=20.0,
        default_frames=81,
        default_width=832,
        default_height=480,
        default_steps=50,
        default_guidance=5.0,
        default_fps=16,
        negative_prompt=True,
        attention_backends=True,
        repeated_blocks=True,
        task_type=IMAGE_TO_VIDEO,
    ),
    # CogVideoX-5b-I2V (1.0) has learned positional embeddings for its 90x60 latent grid, so its transformer refuses
    # any size but 720x480 ("not possible to generate videos at a different resolution"); the limits below stop
    # larger ones at submit, a smaller one fails the task (INVALID_PARAMETERS). CogVideoX1.5-5B-I2V (rotary
    # embeddings only) takes any size: raise max_width, max_height and max_frames (1360x768, 81 frames). Frames as
    # CogVideoXPipeline: the VAE decodes latent frames in pairs.
    "CogVideoXImageToVideoPipeline": Family(
        label="CogVideoX I2V",
        frame_step=8,
        size_multiple=16,
        max_frames=49,
        max_width=720,
        max_height=480,
        max_steps=100,
        max_guidance=20.0,
        default_frames=49,
        default_width=720,
        default_height=480,
        default_steps=50,
        default_guidance=6.0,
        default_fps=8,
        negative_prompt=True,
        attention_backends=False,
        repeated_blocks=False,
        task_type=IMAGE_TO_VIDEO,
    ),
    # LTX-Video 0.9.x I2V: the text model's weights (diffusers loads Lightricks/LTX-Video as either class, and so does
    # the worker: a folder saved as LTXPipeline serves an entry of this class); the image's latent is the first latent
    # frame, so the frame rule stays the text model's.
    "LTXImageToVideoPipeline": Family(
        label="LTX-Video I2V",
        frame_step=8,
        size_multiple=32,
        max_frames=257,
        max_width=1280,
        max_height=1280,
        max_steps=100,
        max_guidance=20.0,
        default_frames=161,
        default_width=704,
        default_height=480,
        default_steps=50,
        default_guidance=3.0,
        default_fps=25,
        negative_prompt=True,
        attention_backends=True,
        repeated_blocks=True,
        task_type=IMAGE_TO_VIDEO,
        loads_from=("LTXPipeline",),
    ),
    # HunyuanVideo-I2V (720p, 129 frames): as HunyuanVideoPipeline, guidance_scale is the embedded guidance (6.0 in
    # diffusers' example) and a negative prompt is ignored unless true_cfg_scale > 1. diffusers' example calls the
    # -33ch variant with guidance 1.0: set default_guidance for it.
    "HunyuanVideoImageToVideoPipeline": Family(
        label="HunyuanVideo I2V",
        frame_step=4,
        size_multiple=16,
        max_frames=129,
        max_width=1280,
        max_height=1280,
        max_steps=100,
        max_guidance=20.0,
        default_frames=129,
        default_width=1280,
        default_height=720,
        default_steps=50,
        default_guidance=6.0,
        default_fps=24,
        negative_prompt=False,
        attention_backends=True,
        repeated_blocks=True,
        task_type=IMAGE_TO_VIDEO,
    ),
}


def family_of(pipeline: str | None) -> Family | None:
    """The family of a pipeline class name, or None for a class the table does not know."""
    return FAMILIES.get(pipeline) if pipeline else None
