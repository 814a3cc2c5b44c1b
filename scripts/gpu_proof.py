"""GPU proof at real model sizes (issue 28): every family's transformer and VAE built from its published configuration
with random weights, timed at the family's default size and frames on CUDA; the tiny pipelines' correctness on CUDA.

For Wan 2.1 T2V 1.3B, CogVideoX-2B, LTX-Video (0.9.0) and HunyuanVideo: seconds per denoising step, VAE decode time and
peak GPU memory through the worker's own call (services.worker.inference.VideoPipeline), then the step time again with
one alternative attention backend (where installed and the family honours it) and with torch_compile ("blocks", or
"transformer" for CogVideoX, applied by the worker's own option code); HunyuanVideo runs with fewer blocks by default
(--hunyuan-layers) and says so. The text encoders are small stand-ins with the real output widths (their cost is not
what is measured); tokenizers and schedulers come from taskgate_local.tinymodel. Then the worker's device split serving
a saturated queue with worker_slots_per_device 1.0 and 1.5 (--busy lanes: services.worker.devices, no servers; --busy
worker: the whole worker draining a JetStream queue, needs the embedded PostgreSQL and NATS). Every figure goes to a
JSON (--out) after each phase; the whole run stays within --budget seconds, skipping what is left with a note.

Without CUDA it prints one SKIP line, writes {"skipped": ...} and exits 0 at once (it imports torch only).
`--device cpu --layers 1 --tiny` is the dry mode: the same code on the CPU, one block per stack, the smallest valid
video, which proves that the configurations are accepted by the installed diffusers classes and that every phase runs.
`--report FILE` prints the GPU proof table (docs/operations.md) of a JSON written earlier.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import faulthandler
import gc
import importlib.util
import inspect
import json
import math
import os
import platform
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
# Run from a checkout without installing the package (the device machine gets a bare copy of the tree).
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

PROMPT = "a red car drives on a wet road at night, cinematic, high quality"
SEED = 1234

# ---- published configurations (diffusers format; random weights here, nothing is downloaded) ----
#
# Wan 2.1 T2V 1.3B (Wan-AI/Wan2.1-T2V-1.3B-Diffusers): diffusers' scripts/convert_wan_to_diffusers.py, model type
# "Wan-T2V-1.3B" (dim 1536 = 12 heads x 128, ffn 8960, 30 layers, as Wan's own configs/wan_t2v_1_3B.py says); the rest
# are WanTransformer3DModel's defaults, which that config leaves as they are. VAE: AutoencoderKLWan() defaults, which
# the same script converts the Wan2.1 VAE into.
WAN_T2V_1_3B: dict[str, Any] = {
    "patch_size": [1, 2, 2],
    "num_attention_heads": 12,
    "attention_head_dim": 128,
    "in_channels": 16,
    "out_channels": 16,
    "text_dim": 4096,
    "freq_dim": 256,
    "ffn_dim": 8960,
    "num_layers": 30,
    "cross_attn_norm": True,
    "qk_norm": "rms_norm_across_heads",
    "eps": 1e-6,
    "image_dim": None,
    "added_kv_proj_dim": None,
    "rope_max_seq_len": 1024,
}
WAN_VAE: dict[str, Any] = {
    "base_dim": 96, "z_dim": 16, "dim_mult": [1, 2, 4, 4], "num_res_blocks": 2, "attn_scales": [],
    "temperal_downsample": [False, True, True], "dropout": 0.0,
}
# CogVideoX-2B (THUDM/CogVideoX-2b): scripts/convert_cogvideox_to_diffusers.py builds it from
# CogVideoXTransformer3DModel's defaults with num_layers 30, num_attention_heads 30 and no RoPE ("For CogVideoX-2B
# ..."), its VAE from AutoencoderKLCogVideoX's defaults with scaling_factor 1.15258426.
COGVIDEOX_2B: dict[str, Any] = {
    "num_attention_heads": 30,
    "attention_head_dim": 64,
    "in_channels": 16,
    "out_channels": 16,
    "flip_sin_to_cos": True,
    "freq_shift": 0,
    "time_embed_dim": 512,
    "text_embed_dim": 4096,
    "num_layers": 30,
    "dropout": 0.0,
    "attention_bias": True,
    "sample_width": 90,
    "sample_height": 60,
    "sample_frames": 49,
    "patch_size": 2,
    "temporal_compression_ratio": 4,
    "max_text_seq_length": 226,
    "activation_fn": "gelu-approximate",
    "timestep_activation_fn": "silu",
    "norm_elementwise_affine": True,
    "norm_eps": 1e-5,
    "spatial_interpolation_scale": 1.875,
    "temporal_interpolation_scale": 1.0,
    "use_rotary_positional_embeddings": False,
    "use_learned_positional_embeddings": False,
}
COGVIDEOX_VAE: dict[str, Any] = {
    "in_channels": 3,
    "out_channels": 3,
    "down_block_types": ["CogVideoXDownBlock3D"] * 4,
    "up_block_types": ["CogVideoXUpBlock3D"] * 4,
    "block_out_channels": [128, 256, 256, 512],
    "latent_channels": 16,
    "layers_per_block": 3,
    "act_fn": "silu",
    "norm_eps": 1e-6,
    "norm_num_groups": 32,
    "temporal_compression_ratio": 4,
    "sample_height": 480,
    "sample_width": 720,
    "scaling_factor": 1.15258426,
    "use_quant_conv": False,
    "use_post_quant_conv": False,
}
# LTX-Video 0.9.0 (Lightricks/LTX-Video): scripts/convert_ltx_to_diffusers.py builds the transformer as
# LTXVideoTransformer3DModel() (28 layers, 32 heads x 64, cross-attention 2048, captions 4096) and the VAE from its
# get_vae_config("0.9.0") (latent 128, patch 4, no timestep conditioning), which AutoencoderKLLTXVideo's defaults equal.
LTX_VIDEO: dict[str, Any] = {
    "in_channels": 128, "out_channels": 128, "patch_size": 1, "patch_size_t": 1, "num_attention_heads": 32,
    "attention_head_dim": 64, "cross_attention_dim": 2048, "num_layers": 28, "activation_fn": "gelu-approximate",
    "qk_norm": "rms_norm_across_heads", "norm_elementwise_affine": False, "norm_eps": 1e-6, "caption_channels": 4096,
    "attention_bias": True, "attention_out_bias": True,
}
LTX_VAE: dict[str, Any] = {
    "in_channels": 3, "out_channels": 3, "latent_channels": 128, "block_out_channels": [128, 256, 512, 512],
    "decoder_block_out_channels": [128, 256, 512, 512], "layers_per_block": [4, 3, 3, 3, 4],
    "decoder_layers_per_block": [4, 3, 3, 3, 4], "spatio_temporal_scaling": [True, True, True, False],
    "decoder_spatio_temporal_scaling": [True, True, True, False], "decoder_inject_noise": [False] * 5,
    "upsample_residual": [False] * 4, "upsample_factor": [1] * 4, "timestep_conditioning": False, "patch_size": 4,
    "patch_size_t": 1, "resnet_norm_eps": 1e-6, "scaling_factor": 1.0, "encoder_causal": True, "decoder_causal": False,
}
# HunyuanVideo (hunyuanvideo-community/HunyuanVideo): scripts/convert_hunyuan_video_to_diffusers.py builds the
# transformer as HunyuanVideoTransformer3DModel() (20 dual-stream + 40 single-stream blocks, 24 heads x 128, the same
# numbers as the original's mm_double_blocks_depth 20 / mm_single_blocks_depth 40 / rope_dim_list [16, 56, 56]) and the
# VAE as AutoencoderKLHunyuanVideo() (scaling_factor 0.476986).
HUNYUAN_VIDEO: dict[str, Any] = {
    "in_channels": 16,
    "out_channels": 16,
    "num_attention_heads": 24,
    "attention_head_dim": 128,
    "num_layers": 20,
    "num_single_layers": 40,
    "num_refiner_layers": 2,
    "mlp_ratio": 4.0,
    "patch_size": 2,
    "patch_size_t": 1,
    "qk_norm": "rms_norm",
    "guidance_embeds": True,
    "text_embed_dim": 4096,
    "pooled_projection_dim": 768,
    "rope_theta": 256.0,
    "rope_axes_dim": [16, 56, 56],
}
HUNYUAN_VAE: dict[str, Any] = {
    "in_channels": 3, "out_channels": 3, "latent_channels": 16, "down_block_types": ["HunyuanVideoDownBlock3D"] * 4,
    "up_block_types": ["HunyuanVideoUpBlock3D"] * 4, "block_out_channels": [128, 256, 512, 512], "layers_per_block": 2,
    "act_fn": "silu", "norm_num_groups": 32, "scaling_factor": 0.476986, "spatial_compression_ratio": 8,
    "temporal_compression_ratio": 4, "mid_block_add_attention": True,
}


@dataclass(frozen=True)
class Proof:
    """One family's real model: its published configuration and how docs/models.md's entry runs it on an 80 GB GPU."""

    key: str
    pipeline: str  # the diffusers pipeline class (taskgate.families key)
    model: str
    repo: str
    transformer_class: str
    transformer: dict[str, Any]
    vae_class: str
    vae: dict[str, Any]
    layer_keys: tuple[str, ...]  # the transformer's repeated-block counts (what --layers caps)
    text_width: str  # the transformer config key that is the text encoder's output width
    compile: str  # torch_compile value: "blocks" (regional) or "transformer" (CogVideoX declares no repeated blocks)
    pooled_width: str | None = None  # HunyuanVideo: the CLIP encoder's pooled width
    vae_tiling: bool = False
    vae_slicing: bool = False
    core_estimate_s: float = 40.0  # rough H200 seconds for build + one worker call (budget reserve only)
    full_blocks: int = 0  # repeated blocks of the full model that dominate a step (0: the layer_keys' sum)


PROOFS: dict[str, Proof] = {
    "wan": Proof(
        key="wan",
        pipeline="WanPipeline",
        model="Wan 2.1 T2V 1.3B",
        repo="Wan-AI/Wan2.1-T2V-1.3B-Diffusers",
        transformer_class="WanTransformer3DModel",
        transformer=WAN_T2V_1_3B,
        vae_class="AutoencoderKLWan",
        vae=WAN_VAE,
        layer_keys=("num_layers",),
        text_width="text_dim",
        compile="blocks",
        core_estimate_s=35.0,
    ),
    "ltx": Proof(
        key="ltx",
        pipeline="LTXPipeline",
        model="LTX-Video 0.9.0 (2B)",
        repo="Lightricks/LTX-Video",
        transformer_class="LTXVideoTransformer3DModel",
        transformer=LTX_VIDEO,
        vae_class="AutoencoderKLLTXVideo",
        vae=LTX_VAE,
        layer_keys=("num_layers",),
        text_width="caption_channels",
        compile="blocks",
        core_estimate_s=30.0,
    ),
    "cogvideox": Proof(
        key="cogvideox",
        pipeline="CogVideoXPipeline",
        model="CogVideoX-2B",
        repo="THUDM/CogVideoX-2b",
        transformer_class="CogVideoXTransformer3DModel",
        transformer=COGVIDEOX_2B,
        vae_class="AutoencoderKLCogVideoX",
        vae=COGVIDEOX_VAE,
        layer_keys=("num_layers",),
        text_width="text_embed_dim",
        compile="transformer",
        vae_tiling=True,
        vae_slicing=True,
        core_estimate_s=40.0,
    ),
    "hunyuan": Proof(
        key="hunyuan",
        pipeline="HunyuanVideoPipeline",
        model="HunyuanVideo (13B)",
        repo="hunyuanvideo-community/HunyuanVideo",
        transformer_class="HunyuanVideoTransformer3DModel",
        transformer=HUNYUAN_VIDEO,
        vae_class="AutoencoderKLHunyuanVideo",
        vae=HUNYUAN_VAE,
        layer_keys=("num_layers", "num_single_layers", "num_refiner_layers"),
        text_width="text_embed_dim",
        compile="blocks",
        pooled_width="pooled_projection_dim",
        vae_tiling=True,
        core_estimate_s=70.0,
        full_blocks=60,
    ),
}

# Attention backends to try, best first, and the module each needs; diffusers' built-in cuDNN path needs nothing more.
CUDA_BACKENDS: tuple[tuple[str, str | None], ...] = (
    ("_flash_3", "flash_attn_interface"), ("flash", "flash_attn"), ("sage", "sageattention"), ("_native_cudnn", None),
    ("_native_efficient", None),
)
CPU_BACKENDS: tuple[tuple[str, str | None], ...] = (("_native_math", None),)
# What the script imports beyond torch once it runs (the device machine's image lacks some: carry them as wheels).
NEEDED_MODULES = (
    "diffusers",
    "transformers",
    "numpy",
    "av",
    "pydantic",
    "pydantic_settings",
    "opentelemetry",
    "prometheus_client",
)


# ---- small helpers ----


def sync(device: str) -> None:
    """Wait for the device's queued work, so wall-clock stamps mean something."""
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def reset_peak(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()


def peak_mib(device: str) -> float | None:
    """The most GPU memory allocated since the last reset_peak (None off CUDA)."""
    return round(torch.cuda.max_memory_allocated() / 2**20, 1) if device.startswith("cuda") else None


def shown_mib(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.0f} MiB"


def free_memory(device: str) -> None:
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()


def mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else math.nan


def step_figures(began: float, stamps: list[float]) -> dict[str, Any]:
    """Per-step seconds from the stamps taken after each step: the first interval also holds prompt encoding, latent
    preparation and first-call kernel set-up, so the steady figure is the mean of the others (the first when alone)."""
    gaps = [b - a for a, b in zip([began, *stamps[:-1]], stamps, strict=True)]
    steady = gaps[1:] or gaps[:1]
    return {"first_step_s": round(gaps[0], 4) if gaps else None, "step_s": [round(g, 4) for g in gaps],
            "seconds_per_step": round(mean(steady), 4) if steady else None}


def monotonic(progress: list[tuple[int, int]], steps: int) -> bool:
    """Whether on_step reported 1, 2, ..., steps of one constant total."""
    return [d for d, _ in progress] == list(range(1, steps + 1)) and len({t for _, t in progress}) == 1


def params_mib(module: Any) -> float:
    if not isinstance(module, torch.nn.Module):
        return 0.0
    return round(sum(p.numel() * p.element_size() for p in module.parameters()) / 2**20, 1)


def cast_like_loaded(module: torch.nn.Module, dtype: torch.dtype) -> None:
    """To `dtype` as from_pretrained(dtype=...) would load it: the class's _keep_in_fp32_modules stay float32."""
    module.to(dtype)
    keep = getattr(type(module), "_keep_in_fp32_modules", None) or []
    names = [keep] if isinstance(keep, str) else list(keep)
    if dtype == torch.float32 or not names:
        return
    for name, tensor in [*module.named_parameters(), *module.named_buffers()]:
        if tensor.is_floating_point() and any(k in name.split(".") for k in names):
            tensor.data = tensor.data.to(torch.float32)


class Budget:
    """The run's time bound: what is left, and whether a phase of some estimated length still fits."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.started = time.monotonic()

    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def left(self) -> float:
        return self.seconds - self.elapsed()

    def allows(self, need: float, reserve: float = 0.0) -> bool:
        return self.left() - reserve >= need


@dataclass
class Report:
    """Everything measured, written to the JSON after every phase."""

    path: Path
    doc: dict[str, Any] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)

    def note(self, text: str) -> None:
        print(f"NOTE: {text}", flush=True)
        self.doc.setdefault("notes", []).append(text)

    def fail(self, text: str) -> None:
        print(f"FAIL: {text}", flush=True)
        self.failures.append(text)
        self.doc["failures"] = self.failures

    def write(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        staging = self.path.with_name(f".{self.path.name}.{os.getpid()}")
        staging.write_text(json.dumps(self.doc, indent=2, sort_keys=False) + "\n")
        staging.replace(self.path)


# ---- building a real-size pipeline ----


def layer_counts(proof: Proof, args: argparse.Namespace) -> dict[str, int]:
    """The repeated-block counts used: the published ones, HunyuanVideo's cut to --hunyuan-layers (dual-stream; twice
    as many single-stream, the published ratio), every one capped at --layers."""
    counts = {k: int(proof.transformer[k]) for k in proof.layer_keys}
    if proof.key == "hunyuan" and args.hunyuan_layers:
        counts["num_layers"] = min(counts["num_layers"], args.hunyuan_layers)
        counts["num_single_layers"] = min(counts["num_single_layers"], 2 * args.hunyuan_layers)
    if args.layers:
        counts = {k: min(v, args.layers) for k, v in counts.items()}
    return counts


def depth_fraction(proof: Proof, counts: dict[str, int]) -> float:
    """The share of the full model's step-dominating blocks that were built."""
    keys = ("num_layers", "num_single_layers") if proof.key == "hunyuan" else proof.layer_keys
    used = sum(counts[k] for k in keys)
    full = proof.full_blocks or sum(int(proof.transformer[k]) for k in keys)
    return used / full


def widened(encoder: Any, width: int, seed: int) -> Any:
    """The tiny text encoder rebuilt with the real model's output width (still 2 small layers): a stand-in whose
    output has the shape the real transformer takes."""
    config = copy.deepcopy(encoder.config)
    setattr(config, "d_model" if hasattr(config, "d_model") else "hidden_size", width)
    torch.manual_seed(seed)
    return type(encoder)(config).eval()


def build_pipeline(proof: Proof, counts: dict[str, int], device: str, dtype: torch.dtype, seed: int = 0) -> Any:
    """The family's diffusers pipeline: real transformer (random weights) and VAE built on `device`, the tiny model's
    tokenizers and scheduler, stand-in text encoders of the real widths; cast as the worker's loader casts."""
    import diffusers

    from taskgate_local import tinymodel

    tiny = tinymodel._BUILDERS[proof.pipeline](seed)
    components = dict(tiny.components)
    components["text_encoder"] = widened(tiny.text_encoder, int(proof.transformer[proof.text_width]), seed)
    if proof.pooled_width is not None:
        components["text_encoder_2"] = widened(tiny.text_encoder_2, int(proof.transformer[proof.pooled_width]), seed)
    torch.manual_seed(seed)
    with torch.device(device):
        components["transformer"] = getattr(diffusers, proof.transformer_class)(**{**proof.transformer, **counts})
        components["vae"] = getattr(diffusers, proof.vae_class)(**proof.vae)
    pipe = type(tiny)(**components)
    for module in pipe.components.values():
        if isinstance(module, torch.nn.Module):
            cast_like_loaded(module, dtype)
            module.eval()
    return pipe.to(device)


# ---- timed runs ----


def request_for(proof: Proof, args: argparse.Namespace, steps: int) -> Any:
    """The family's default request (or the smallest valid one with --tiny), `steps` steps."""
    from services.worker import inference
    from taskgate.families import FAMILIES

    family = FAMILIES[proof.pipeline]
    if args.tiny:
        frames, width, height = 1 + family.frame_step, 2 * family.size_multiple, 2 * family.size_multiple
    else:
        frames, width, height = family.default_frames, family.default_width, family.default_height
    return inference.GenerationRequest(
        prompt=PROMPT, negative_prompt="", num_frames=frames, width=width, height=height, num_inference_steps=steps,
        guidance_scale=family.default_guidance, fps=family.default_fps, seed=SEED,
    )


def worker_call(video: Any, request: Any, device: str) -> dict[str, Any]:
    """One call through the worker's VideoPipeline.render (prompt, denoising, VAE decode, frames to host), then its
    MP4 encoding (the CPU phase); per-step seconds, decode seconds, peak memory, progress order."""
    stamps: list[float] = []
    progress: list[tuple[int, int]] = []

    def on_step(done: int, total: int) -> None:
        sync(device)
        stamps.append(time.perf_counter())
        progress.append((done, total))

    free_memory(device)
    reset_peak(device)
    sync(device)
    began = time.perf_counter()
    rendered = video.render(request, on_step, lambda: False)
    ended = time.perf_counter()
    peak = peak_mib(device)
    encoding = time.perf_counter()
    encoded = video.encode(rendered)
    encode_s = time.perf_counter() - encoding
    shape = tuple(int(n) for n in rendered.frames.shape)
    wanted = (request.num_frames, request.height, request.width, 3)
    return {
        **step_figures(began, stamps),
        "decode_s": round(ended - stamps[-1], 3) if stamps else None,
        "call_s": round(ended - began, 3),
        "encode_s": round(encode_s, 3),
        "mp4_bytes": len(encoded.data),
        "peak_mib": peak,
        "progress_monotonic": monotonic(progress, request.num_inference_steps),
        "frames_shape": list(shape),
        "shape_ok": shape == wanted,
    }


def latent_call(pipe: Any, request: Any, device: str) -> dict[str, Any]:
    """One pipeline call with the worker's arguments but output_type "latent" (no VAE decode): per-step seconds."""
    accepted = inspect.signature(pipe.__call__).parameters
    wanted: dict[str, Any] = {
        "prompt": request.prompt, "negative_prompt": request.negative_prompt, "num_frames": request.num_frames,
        "height": request.height, "width": request.width, "num_inference_steps": request.num_inference_steps,
        "guidance_scale": request.guidance_scale, "frame_rate": request.fps,
        "generator": torch.Generator("cpu").manual_seed(request.resolved_seed()), "output_type": "latent",
    }
    stamps: list[float] = []

    def after_step(_pipe: Any, _step: int, _timestep: Any, callback_kwargs: dict[str, Any]) -> dict[str, Any]:
        sync(device)
        stamps.append(time.perf_counter())
        return callback_kwargs

    kwargs = {k: v for k, v in wanted.items() if k in accepted}
    kwargs["callback_on_step_end"] = after_step
    free_memory(device)
    reset_peak(device)
    sync(device)
    began = time.perf_counter()
    pipe(**kwargs)
    sync(device)
    return {
        **step_figures(began, stamps),
        "call_s": round(time.perf_counter() - began, 3),
        "peak_mib": peak_mib(device),
    }


def backend_candidates(device: str, wanted: str) -> list[str]:
    """Attention backends to try: the named one, or (auto) the installed ones best first."""
    if wanted == "none":
        return []
    if wanted != "auto":
        return [wanted]
    table = CUDA_BACKENDS if device.startswith("cuda") else CPU_BACKENDS
    return [name for name, module in table if module is None or importlib.util.find_spec(module) is not None]


def prove_family(
    proof: Proof,
    args: argparse.Namespace,
    device: str,
    dtype: torch.dtype,
    budget: Budget,
    report: Report,
    reserve: float,
) -> dict[str, Any]:
    """Build one family's real-size pipeline and time it: the worker's call, an attention backend, torch_compile."""
    from services.worker import inference
    from taskgate.families import FAMILIES

    counts = layer_counts(proof, args)
    fraction = depth_fraction(proof, counts)
    full = {k: int(proof.transformer[k]) for k in proof.layer_keys}
    out: dict[str, Any] = {
        "model": proof.model,
        "repo": proof.repo,
        "pipeline": proof.pipeline,
        "transformer_class": proof.transformer_class,
        "layers": counts,
        "published_layers": full,
        "depth_fraction": round(fraction, 4),
        "dtype": str(dtype).removeprefix("torch."),
        "vae_tiling": proof.vae_tiling,
        "vae_slicing": proof.vae_slicing,
        "runs": {},
    }
    report.doc["families"][proof.key] = out  # in every write from here on, also if a later phase breaks
    if counts != full:
        report.note(f"{proof.model}: built with {counts} of the published {full} blocks "
                    f"({fraction:.0%} of the step's blocks); seconds_per_step_full_estimate scales the step by block "
                    f"count")
    started = time.perf_counter()
    pipe = build_pipeline(proof, counts, device, dtype)
    pipe = inference._place(pipe, torch.device(device), inference.LoadOptions(
        pipeline=proof.pipeline, vae_tiling=proof.vae_tiling, vae_slicing=proof.vae_slicing))
    pipe.set_progress_bar_config(disable=True)
    video = inference.VideoPipeline(proof.key, pipe, device, dtype)
    out["build_s"] = round(time.perf_counter() - started, 2)
    out["weights_mib"] = {name: params_mib(module) for name, module in pipe.components.items() if params_mib(module)}
    request = request_for(proof, args, args.steps)
    out.update(frames=request.num_frames, width=request.width, height=request.height, steps=request.num_inference_steps,
               guidance_scale=request.guidance_scale)
    print(
        f"{proof.model}: built in {out['build_s']}s ({counts}, transformer "
        f"{out['weights_mib'].get('transformer', 0):.0f} MiB); {request.num_frames} frames at "
        f"{request.width}x{request.height}, {request.num_inference_steps} steps",
        flush=True,
    )

    eager = worker_call(video, request, device)
    out["runs"]["eager"] = eager
    if eager["seconds_per_step"] is not None and fraction < 1:
        out["seconds_per_step_full_estimate"] = round(eager["seconds_per_step"] / fraction, 3)
    print(f"  eager: {eager['seconds_per_step']} s/step (first {eager['first_step_s']}), decode {eager['decode_s']}s, "
          f"encode {eager['encode_s']}s, peak {shown_mib(eager['peak_mib'])}", flush=True)
    if not eager["progress_monotonic"] or not eager["shape_ok"]:
        report.fail(f"{proof.model}: progress monotonic {eager['progress_monotonic']}, frames {eager['frames_shape']}")
    report.write()
    step = float(eager["seconds_per_step"] or 1.0)

    transformer = pipe.transformer
    if not FAMILIES[proof.pipeline].attention_backends:
        out["runs"]["attention"] = {"skipped": f"{proof.pipeline}'s attention does not honour set_attention_backend"}
    else:
        for name in backend_candidates(device, args.attention_backend)[:2]:
            need = (args.steps + 1) * step + 5
            if not budget.allows(need, reserve):
                out["runs"][f"attention:{name}"] = {
                    "skipped": f"time budget: {budget.left():.0f}s left, ~{need:.0f}s needed"
                }
                report.note(f"{proof.model}: attention backend {name} skipped (time budget)")
                break
            try:
                inference._place(pipe, torch.device(device), inference.LoadOptions(attention_backend=name))
                run = latent_call(pipe, request, device)
                out["runs"][f"attention:{name}"] = run
                print(
                    f"  attention {name}: {run['seconds_per_step']} s/step, peak {shown_mib(run['peak_mib'])}",
                    flush=True,
                )
                break
            except Exception as exc:  # a backend that cannot take these shapes or masks: noted, the next one tried
                out["runs"][f"attention:{name}"] = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
                print(f"  attention {name}: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
            finally:
                transformer.set_attention_backend("native")
    report.write()

    if args.compile == "off":
        out["runs"]["compile"] = {"skipped": "--compile off"}
    else:
        compile_guess = args.compile_estimate * (2.0 if proof.compile == "transformer" else 1.0)
        need = compile_guess + args.steps * step
        if not budget.allows(need, reserve):
            out["runs"][f"compile:{proof.compile}"] = {
                "skipped": f"time budget: {budget.left():.0f}s left, ~{need:.0f}s needed"
            }
            report.note(f"{proof.model}: torch_compile={proof.compile!r} skipped (time budget)")
        else:
            try:
                inference._place(pipe, torch.device(device), inference.LoadOptions(
                    torch_compile=proof.compile, compile_backend=args.compile_backend, compile_mode=args.compile_mode))
                run = latent_call(pipe, request, device)
                if len(run["step_s"]) > 1:  # the first step's excess over the others: compiling
                    run["compile_s"] = round(run["first_step_s"] - run["seconds_per_step"], 2)
                run["backend"] = args.compile_backend
                out["runs"][f"compile:{proof.compile}"] = run
                print(f"  torch_compile={proof.compile} ({args.compile_backend}): {run['seconds_per_step']} s/step, "
                      f"first step {run['first_step_s']}s, peak {shown_mib(run['peak_mib'])}", flush=True)
            except Exception as exc:
                out["runs"][f"compile:{proof.compile}"] = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
                report.fail(f"{proof.model}: torch_compile={proof.compile!r}: {type(exc).__name__}: {str(exc)[:200]}")
    del video, pipe, transformer
    if args.compile != "off":
        importlib.import_module("torch._dynamo").reset()  # compiled blocks of this family out of the caches
    free_memory(device)
    return out


# ---- correctness of the tiny pipelines ----


def tiny_checks(device: str, folder: Path, steps: int) -> dict[str, Any]:
    """Every tiny model through the worker's own load and runner: same seed -> same MP4 bytes (also after an abort),
    progress 1..steps, an abort asked after step 2 stops right there."""
    from services.worker import runner as runmod
    from taskgate.families import FAMILIES, IMAGE_TO_VIDEO
    from taskgate_local import tinymodel

    results: dict[str, Any] = {}
    for name, pipeline in tinymodel.TINY_MODELS.items():
        family = FAMILIES[pipeline]
        frames, size = 1 + 2 * family.frame_step, 64
        try:
            tinymodel.build_tiny_pipeline(folder / name, pipeline=pipeline)
            spec = tinymodel.tiny_spec(
                pipeline, folder / name, default_frames=frames, default_width=size, default_height=size
            )
            runner = runmod.DiffusersRunner.load(name, spec, device)
            params = {
                "num_frames": frames,
                "width": size,
                "height": size,
                "num_inference_steps": steps,
                "guidance_scale": 5.0,
                "fps": 8,
                "seed": SEED,
                "negative_prompt": "",
            }
            from scripts.gpu_check import input_image  # an image-to-video class runs from a stored input image

            image = input_image(size) if family.task_type == IMAGE_TO_VIDEO else None
            inp = runmod.RunInput(1, 1, PROMPT, params, image=image)
            digests: list[str] = []
            ordered: list[bool] = []
            per_step: list[float] = []
            for _ in range(2):
                progress: list[tuple[int, int]] = []
                stamps: list[float] = []

                def on_step(
                    done: int, total: int, progress: list[tuple[int, int]] = progress, stamps: list[float] = stamps
                ) -> None:
                    sync(device)
                    stamps.append(time.perf_counter())
                    progress.append((done, total))

                sync(device)
                began = time.perf_counter()
                digests.append(runner.encode(runner.render(inp, on_step, lambda: False)).sha256)
                ordered.append(monotonic(progress, steps))
                per_step.append(float(step_figures(began, stamps)["seconds_per_step"] or 0.0))
            seen: list[int] = []
            aborted = False

            def noted(done: int, _total: int, seen: list[int] = seen) -> None:
                seen.append(done)

            def two_done(seen: list[int] = seen) -> bool:
                return len(seen) >= 2

            try:
                runner.render(inp, noted, two_done)
            except runmod.RunAborted:
                aborted = True
            after = runner.encode(runner.render(inp, lambda _d, _t: None, lambda: False)).sha256
            results[name] = {
                "pipeline": pipeline, "frames": frames, "size": size, "steps": steps, "sha256": digests[0][:16],
                "deterministic": len(set(digests)) == 1, "same_after_abort": after == digests[0],
                "progress_monotonic": all(ordered), "abort_within_one_step": aborted and seen == [1, 2],
                "seconds_per_step": round(min(per_step), 5),
            }
            del runner
        except Exception as exc:
            results[name] = {"pipeline": pipeline, "error": f"{type(exc).__name__}: {str(exc)[:300]}"}
        print(f"tiny {name}: {results[name]}", flush=True)
        free_memory(device)
    return results


# ---- device-busy fraction under a saturated queue ----


async def lanes_busy(runner: Any, device: str, *, tasks: int, slots: int, params: dict[str, Any]) -> dict[str, Any]:
    """The worker's split without its servers: `slots` tasks at once, each device phase on the device's one lane
    (services.worker.devices), MP4 encoding on other threads meanwhile."""
    from scripts.gpu_check import saturate  # one saturated-queue loop for both GPU scripts
    from services.worker import runner as runmod

    inputs = [runmod.RunInput(n + 1, 1, f"{PROMPT} {n}", {**params, "seed": n}) for n in range(tasks)]
    busy, wall = await saturate(runner, device, inputs, slots=slots)
    return {"tasks": tasks, "slots": slots, "wall_s": round(wall, 2), "busy_s": round(busy, 2),
            "busy_fraction": round(busy / wall, 4), "tasks_per_minute": round(60 * tasks / wall, 2)}


async def worker_busy(runner: Any, spec: Any, device: str, state_dir: Path, *, tasks: int, slot_counts: list[int],
                      params: dict[str, Any]) -> list[dict[str, Any]]:
    """The whole worker (services.worker.engine.Worker) draining a saturated JetStream queue on `device`, as
    bench/device_busy.py does on the CPU: embedded PostgreSQL and NATS, the task rows queued before it starts."""
    from services.worker import runner as runmod
    from services.worker.engine import Worker
    from taskgate import store
    from taskgate.config import Settings
    from taskgate.runtime import connect
    from taskgate.states import Status
    from taskgate.store import bench as bench_store
    from taskgate.wire import dispatch
    from taskgate_local.embedded import EmbeddedStack
    from tests.support.factories import insert_task

    model = runner.model_id
    stack = EmbeddedStack(state_dir / "servers").start()
    figures: list[dict[str, Any]] = []
    try:
        assert stack.postgres is not None and stack.nats is not None
        settings = Settings(
            database_url=stack.postgres.url, nats_url=stack.nats.url, state_dir=state_dir, models={model: spec},
            default_model=model, result_store="fs", worker_metrics_port=0, progress_interval_seconds=1.0,
        )
        backends = await connect(settings, "gpu-proof")
        try:
            for slots in slot_counts:
                rows = []
                for n in range(tasks):
                    task = await insert_task(
                        backends.pool, model_id=model, prompt=f"{PROMPT} {slots} {n}", params={**params, "seed": n}
                    )
                    queued = await store.queue(backends.pool, task.id, actor="gpu-proof")
                    assert queued.task is not None
                    await dispatch.publish(backends.bus, queued.task, dispatch.Reason.SUBMITTED)
                    rows.append(task.id)
                plan = runmod.DevicePlan([device], slots, device.startswith("cuda"), float(slots))
                worker = Worker(settings, backends, {(model, device): runner}, plan, f"gpu-proof-{slots}", [model])
                started = time.monotonic()
                await worker.start()
                try:
                    while True:
                        counts = await bench_store.count_by_status(backends.pool, rows)
                        if counts.get(Status.SUCCEEDED.value, 0) == tasks:
                            break
                        if counts.get(Status.FAILED.value, 0):
                            raise RuntimeError(f"a task failed: {counts}")
                        await asyncio.sleep(0.05)
                    wall = time.monotonic() - started
                finally:
                    await worker.close()
                busy = worker.devices.busy_seconds
                figures.append(
                    {
                        "tasks": tasks,
                        "slots": slots,
                        "wall_s": round(wall, 2),
                        "busy_s": round(busy, 2),
                        "busy_fraction": round(busy / wall, 4),
                        "tasks_per_minute": round(60 * tasks / wall, 2),
                    }
                )
                print(f"  worker, {slots} slot(s): {figures[-1]}", flush=True)
        finally:
            await backends.close()
    finally:
        stack.stop()
    return figures


def prove_busy(proof: Proof, args: argparse.Namespace, device: str, dtype: torch.dtype, budget: Budget, report: Report,
               eager: dict[str, Any] | None) -> dict[str, Any]:
    """A saturated queue of the family's default-size tasks (--busy-steps steps each) at worker_slots_per_device 1.0
    and 1.5: the device-busy fraction and tasks per minute."""
    from services.worker import inference
    from services.worker import runner as runmod
    from taskgate.config import ModelSpec

    slot_counts = [math.ceil(1 * per_device) for per_device in (1.0, 1.5)]
    need = 60.0  # without this family's figures: a rough H200 guess
    if eager and eager.get("seconds_per_step") is not None:
        per_task = sum(float(eager[k] or 0) for k in ("first_step_s", "decode_s", "encode_s"))
        per_task += (args.busy_steps - 1) * float(eager["seconds_per_step"])
        # build + one warm task, then each queue (two slots finish sooner by overlapping encoding with the device)
        need = 15 + per_task + 1.2 * sum(args.busy_tasks * per_task / (1 if s == 1 else 1.3) for s in slot_counts)
    if not budget.allows(need):
        report.note(f"device-busy phase skipped (time budget: {budget.left():.0f}s left, ~{need:.0f}s needed)")
        return {"skipped": f"time budget: {budget.left():.0f}s left, ~{need:.0f}s needed"}
    counts = layer_counts(proof, args)
    pipe = build_pipeline(proof, counts, device, dtype)
    pipe = inference._place(pipe, torch.device(device), inference.LoadOptions(
        pipeline=proof.pipeline, vae_tiling=proof.vae_tiling, vae_slicing=proof.vae_slicing))
    pipe.set_progress_bar_config(disable=True)
    request = request_for(proof, args, args.busy_steps)
    spec = ModelSpec(
        path=Path(tempfile.gettempdir()) / "gpu-proof-model",
        pipeline=proof.pipeline,
        vae_tiling=proof.vae_tiling,
        vae_slicing=proof.vae_slicing,
    )
    runner = runmod.DiffusersRunner(proof.key, spec, inference.VideoPipeline(proof.key, pipe, device, dtype))
    params = {"num_frames": request.num_frames, "width": request.width, "height": request.height,
              "num_inference_steps": args.busy_steps, "guidance_scale": request.guidance_scale, "fps": request.fps,
              "negative_prompt": ""}
    runner.encode(runner.render(runmod.RunInput(0, 1, PROMPT, params), lambda _d, _t: None, lambda: False))  # warm
    out: dict[str, Any] = {"model": proof.model, "mode": args.busy, "layers": counts, "frames": request.num_frames,
                           "width": request.width, "height": request.height, "steps": args.busy_steps, "settings": []}
    if args.busy == "lanes":
        for per_device, slots in zip((1.0, 1.5), slot_counts, strict=True):
            figure = asyncio.run(lanes_busy(runner, device, tasks=args.busy_tasks, slots=slots, params=params))
            figure["worker_slots_per_device"] = per_device
            out["settings"].append(figure)
            print(f"  lanes, slots_per_device {per_device} ({slots} at once): {figure}", flush=True)
    else:
        with tempfile.TemporaryDirectory(prefix="taskgate-gpu-proof-") as tmp:
            figures = asyncio.run(
                worker_busy(
                    runner, spec, device, Path(tmp), tasks=args.busy_tasks, slot_counts=slot_counts, params=params
                )
            )
        for per_device, figure in zip((1.0, 1.5), figures, strict=True):
            figure["worker_slots_per_device"] = per_device
            out["settings"].append(figure)
    del runner, pipe
    free_memory(device)
    return out


# ---- the table ----


def _cell(value: Any, digits: int = 3) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "—"
    return f"{value:.{digits}f}" if isinstance(value, float) else str(value)


def table(doc: dict[str, Any]) -> str:
    """The GPU proof table (Markdown, docs/operations.md) of a proof's JSON."""
    if "skipped" in doc or "error" in doc:
        return f"skipped: {doc['skipped']}" if "skipped" in doc else f"error: {doc['error']}"
    lines = [
        "| model | blocks built | frames, WxH | s/step eager | attention backend: s/step | torch_compile: s/step "
        "(compile s) | VAE decode s | MP4 encode s | peak GiB |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for fam in doc.get("families", {}).values():
        if "runs" not in fam or "frames" not in fam:
            lines.append(f"| {fam.get('model', '?')} | {fam.get('error') or fam.get('skipped') or '?'} | | | | | | | |")
            continue
        runs = fam.get("runs", {})
        eager = runs.get("eager", {})
        blocks = ", ".join(f"{v}/{fam['published_layers'][k]}" for k, v in fam["layers"].items())
        step = _cell(eager.get("seconds_per_step"))
        if "seconds_per_step_full_estimate" in fam:
            step += f" (full depth ≈ {_cell(fam['seconds_per_step_full_estimate'], 2)})"
        attention = next(
            (
                (k.split(":", 1)[1], v)
                for k, v in runs.items()
                if k.startswith("attention:") and "seconds_per_step" in v
            ),
            None,
        )
        attn = f"{attention[0]}: {_cell(attention[1]['seconds_per_step'])}" if attention else "—"
        compiled = next(
            ((k.split(":", 1)[1], v) for k, v in runs.items() if k.startswith("compile:") and "seconds_per_step" in v),
            None,
        )
        comp = (
            f"{compiled[0]}: {_cell(compiled[1]['seconds_per_step'])} ({_cell(compiled[1].get('compile_s'), 0)})"
            if compiled
            else "—"
        )
        peak = eager.get("peak_mib")
        lines.append(
            f"| {fam['model']} | {blocks} | {fam['frames']}, {fam['width']}x{fam['height']} | {step} | {attn} | {comp} "
            f"| {_cell(eager.get('decode_s'), 2)} | {_cell(eager.get('encode_s'), 2)} | "
            f"{_cell(peak / 1024 if peak else None, 1)} |"
        )
    busy = doc.get("busy", {})
    if busy.get("settings"):
        lines += [
            "",
            "| device-busy ("
            + busy["mode"]
            + f", {busy['model']}, {busy['steps']} steps) | slots | busy | tasks/min | wall s |",
            "|---|---|---|---|---|",
        ]
        for figure in busy["settings"]:
            lines.append(f"| worker_slots_per_device {figure['worker_slots_per_device']} | {figure['slots']} "
                         f"| {figure['busy_fraction']:.1%} | {figure['tasks_per_minute']} | {figure['wall_s']} |")
    tiny = doc.get("tiny", {})
    if tiny:
        ok = [
            n
            for n, r in tiny.items()
            if r.get("deterministic") and r.get("progress_monotonic") and r.get("abort_within_one_step")
        ]
        lines += [
            "",
            f"tiny pipelines on {doc.get('device', '?')}: same bytes, monotonic progress, abort within one step: "
            f"{', '.join(ok) or 'none'} of {', '.join(tiny)}",
        ]
    return "\n".join(lines)


# ---- main ----


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    state = Path(os.environ.get("TASKGATE_STATE_DIR") or ".taskgate")
    parser.add_argument("--out", type=Path, default=state / "gpu-proof.json", help="the JSON of every figure")
    parser.add_argument("--device", default="cuda", help="cuda (skips without it) or cpu (the dry mode)")
    parser.add_argument(
        "--budget", type=float, default=480.0, help="seconds for the whole run; what does not fit is skipped"
    )
    parser.add_argument("--families", default=",".join(PROOFS), help=f"comma-separated, of {', '.join(PROOFS)}")
    parser.add_argument("--steps", type=int, default=3, help="denoising steps per timed call (the first is set apart)")
    parser.add_argument("--layers", type=int, default=0, help="cap every repeated-block count at this (0: published)")
    parser.add_argument("--hunyuan-layers", type=int, default=2,
                        help="HunyuanVideo dual-stream blocks (twice as many single-stream); 0: the full 20 + 40")
    parser.add_argument(
        "--tiny", action="store_true", help="the smallest valid frames and size instead of the defaults"
    )
    parser.add_argument(
        "--attention-backend", default="auto", help="auto (installed, best first), none, or a diffusers name"
    )
    parser.add_argument(
        "--compile", choices=["on", "off"], default="on", help="also time torch_compile (blocks/transformer)"
    )
    parser.add_argument("--compile-backend", default=None,
                        help="torch.compile backend (default inductor on CUDA, eager on the CPU: there it only traces)")
    parser.add_argument("--compile-mode", default=None, help="torch.compile mode")
    parser.add_argument(
        "--compile-estimate", type=float, default=60.0, help="seconds a regional compile is assumed to take"
    )
    parser.add_argument(
        "--tiny-checks", choices=["on", "off"], default="on", help="same-seed bytes, progress, abort (tiny models)"
    )
    parser.add_argument("--busy", choices=["lanes", "worker", "off"], default="lanes",
                        help="device-busy phase: lanes (no servers), worker (embedded PostgreSQL + NATS), off")
    parser.add_argument("--busy-family", default="wan", choices=sorted(PROOFS))
    parser.add_argument("--busy-tasks", type=int, default=3, help="tasks per queue")
    parser.add_argument("--busy-steps", type=int, default=2, help="denoising steps per queued task")
    parser.add_argument("--grace", type=float, default=120.0,
                        help="on CUDA, a phase still running this long past the budget is stopped (stacks printed, "
                        "exit 1)")
    parser.add_argument("--report", type=Path, default=None, help="print the GPU proof table of this JSON and exit")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Run the proof; 0 when every phase that ran gave correct results (or when there is no GPU: skipped)."""
    args = parse(argv)
    if args.report is not None:
        print(table(json.loads(args.report.read_text())))
        return 0
    report = Report(args.out)
    base: dict[str, Any] = {
        "script": "scripts/gpu_proof.py",
        "at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "torch": torch.__version__,
        "cuda_build": torch.version.cuda,
        "python": platform.python_version(),
    }
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        reason = (f"no CUDA device is visible to torch {torch.__version__} (CUDA build {torch.version.cuda}); "
                  "nothing measured (--device cpu runs the dry mode)")
        print(f"SKIP: {reason}", flush=True)
        report.doc = {"skipped": reason, **base}
        report.write()
        return 0
    missing = [m for m in NEEDED_MODULES if importlib.util.find_spec(m) is None]
    if missing:
        report.doc = {"error": f"missing Python packages: {', '.join(missing)}", **base}
        report.write()
        print(f"FAIL: missing Python packages: {', '.join(missing)} (carry them as wheels)", flush=True)
        return 2
    import diffusers
    import transformers

    from services.worker import inference

    inference._quiet_libraries()
    device = "cuda:0" if args.device == "cuda" else args.device
    if args.compile_backend is None:
        args.compile_backend = "inductor" if device.startswith("cuda") else "eager"
    dtype = inference.resolve_dtype("auto", device)
    keys = [k.strip() for k in args.families.split(",") if k.strip()]
    unknown = [k for k in keys if k not in PROOFS]
    if unknown:
        print(f"FAIL: unknown families {unknown}; known: {', '.join(PROOFS)}", flush=True)
        return 2
    budget = Budget(args.budget)
    if device.startswith("cuda"):
        # One phase cannot be cut short from inside; a hung one (a compile, a kernel) ends the run with its stack, the
        # JSON keeping every phase done before it.
        faulthandler.dump_traceback_later(args.budget + args.grace, exit=True)
    report.doc = {
        **base,
        "diffusers": diffusers.__version__,
        "transformers": transformers.__version__,
        "device": device,
        "device_name": torch.cuda.get_device_name(0) if device.startswith("cuda") else platform.processor() or "cpu",
        "dtype": str(dtype).removeprefix("torch."),
        "budget_s": args.budget,
        "steps": args.steps,
        "tiny_sizes": args.tiny,
        "attention_backends_installed": backend_candidates(device, "auto"),
        "families": {},
        "notes": [],
    }
    print(
        f"gpu proof on {report.doc['device_name']} ({device}, {report.doc['dtype']}), torch {torch.__version__}, "
        f"diffusers {diffusers.__version__}; budget {args.budget:.0f}s; families {', '.join(keys)}",
        flush=True,
    )
    report.write()

    if args.tiny_checks == "on":
        if budget.allows(30, sum(PROOFS[k].core_estimate_s for k in keys)) or not device.startswith("cuda"):
            with tempfile.TemporaryDirectory(prefix="taskgate-gpu-proof-tiny-") as tmp:
                report.doc["tiny"] = tiny_checks(device, Path(tmp), steps=4)
            for name, r in report.doc["tiny"].items():
                if "error" in r:
                    report.fail(f"tiny {name}: {r['error']}")
                elif not (
                    r["deterministic"]
                    and r["same_after_abort"]
                    and r["progress_monotonic"]
                    and r["abort_within_one_step"]
                ):
                    report.fail(f"tiny {name}: {r}")
        else:
            report.note("tiny checks skipped (time budget)")
        report.write()

    for index, key in enumerate(keys):
        proof = PROOFS[key]
        reserve = sum(PROOFS[k].core_estimate_s for k in keys[index + 1:])
        if not budget.allows(proof.core_estimate_s * 0.5):
            report.doc["families"][key] = {"model": proof.model, "skipped": f"time budget: {budget.left():.0f}s left"}
            report.note(f"{proof.model} skipped (time budget: {budget.left():.0f}s left)")
            continue
        try:
            report.doc["families"][key] = prove_family(proof, args, device, dtype, budget, report, reserve)
        except Exception as exc:
            traceback.print_exc()
            # what was measured before it broke stays
            entry = report.doc["families"].setdefault(key, {"model": proof.model})
            entry["error"] = f"{type(exc).__name__}: {str(exc)[:500]}"
            report.fail(f"{proof.model}: {type(exc).__name__}: {str(exc)[:300]}")
            free_memory(device)
        report.doc["elapsed_s"] = round(budget.elapsed(), 1)
        report.write()

    if args.busy != "off":
        proof = PROOFS[args.busy_family]
        eager = report.doc["families"].get(proof.key, {}).get("runs", {}).get("eager")
        try:
            report.doc["busy"] = prove_busy(proof, args, device, dtype, budget, report, eager)
        except Exception as exc:
            traceback.print_exc()
            report.doc["busy"] = {"error": f"{type(exc).__name__}: {str(exc)[:500]}"}
            report.fail(f"device-busy phase: {type(exc).__name__}: {str(exc)[:300]}")
    report.doc["elapsed_s"] = round(budget.elapsed(), 1)
    report.write()
    print(table(report.doc), flush=True)
    print(f"{'FAIL' if report.failures else 'OK'}: {len(report.doc['families'])} families in {budget.elapsed():.0f}s "
          f"(budget {args.budget:.0f}s); figures in {args.out}", flush=True)
    return 1 if report.failures else 0


if __name__ == "__main__":
    sys.exit(main())
