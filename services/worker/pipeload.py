"""Loading a diffusers video pipeline for the worker (services/worker/inference.py runs it): the dtype, the pipeline
class, weights kept in float32 where the model's class pins them, what a pipeline needs of a request (frame step,
size multiple), and placing it on its device with the model's runtime options (offload, attention, compile)."""

from __future__ import annotations

import contextlib
import inspect
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from taskgate import families
from taskgate.config import ModelSpec

_MISSING = object()


def pick_device() -> tuple[str, torch.dtype]:
    """The device and dtype to run on: CUDA in bfloat16 (float16 without bf16 support), else CPU in float32."""
    if torch.cuda.is_available():
        return "cuda", torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return "cpu", torch.float32


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
    spatial = _first_int(
        getattr(pipe, "vae_scale_factor_spatial", None), getattr(pipe, "vae_spatial_compression_ratio", None)
    )
    temporal = _first_int(
        getattr(pipe, "vae_scale_factor_temporal", None), getattr(pipe, "vae_temporal_compression_ratio", None)
    )
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
