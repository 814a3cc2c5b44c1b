"""Model runners: what a slot executes for one task, on its own thread (a diffusers pipeline, a 'sleep' stand-in, or a
'python' model's runner from its factory)."""

from __future__ import annotations

import hashlib
import importlib
import json
import logging
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from taskgate import images, tracing, videoparams
from taskgate.config import ModelSpec

from .runtypes import InputMissing as InputMissing  # the run types, re-exported for runmod.X
from .runtypes import ModelRunner as ModelRunner
from .runtypes import OnStep as OnStep
from .runtypes import Rendered as Rendered
from .runtypes import RunAborted as RunAborted
from .runtypes import RunFailure as RunFailure
from .runtypes import RunInput as RunInput
from .runtypes import RunOutput as RunOutput
from .runtypes import ShouldAbort as ShouldAbort

log = logging.getLogger("taskgate.worker.runner")


def classify(exc: BaseException) -> tuple[bool, str]:
    """(retryable, error_code) of a run's failure: loading, rendering or encoding, of any model."""
    if isinstance(exc, RunFailure):
        return exc.retryable, exc.code
    from services.worker.upstream import UpstreamFailure  # late: the openai client loads only where it is used

    if isinstance(exc, UpstreamFailure):
        return exc.retryable, exc.code
    if isinstance(exc, InputMissing):
        return False, "INPUT_MISSING"
    if isinstance(exc, RunAborted):
        return False, "ABORTED"
    # torch.cuda.OutOfMemoryError, known by name (this module never imports torch), or an error saying the same
    if type(exc).__name__ == "OutOfMemoryError" or "out of memory" in str(exc).lower():
        return True, "CUDA_OOM"
    if isinstance(exc, OSError | ConnectionError | TimeoutError):
        return True, "TRANSIENT_IO"
    if isinstance(exc, ValueError | TypeError):
        return False, "INVALID_PARAMETERS"
    return False, "PIPELINE_ERROR"


class SleepRunner:
    """Holds its device for `sleep_seconds`, one 'step' at a time, and returns a small deterministic JSON payload."""

    def __init__(self, model_id: str, spec: ModelSpec) -> None:
        self.model_id = model_id
        self.spec = spec

    def render(self, inp: RunInput, on_step: OnStep, should_abort: ShouldAbort) -> Rendered:
        """Sleeps step by step, checking the abort flag between steps."""
        steps = max(1, videoparams.stored(inp.params, self.spec).num_inference_steps)
        per_step = self.spec.sleep_seconds / steps
        began = time.time_ns()
        for step in range(1, steps + 1):
            if should_abort():
                raise RunAborted(f"aborted before step {step}")
            if per_step > 0:
                time.sleep(per_step)  # the abort flag is read between steps
            on_step(step, steps)
        tracing.phase("denoise", start_ns=began, end_ns=time.time_ns(), attributes={"taskgate.steps": steps})
        if should_abort():
            raise RunAborted("aborted after the last step")
        return Rendered(inp, steps)

    def encode(self, rendered: Rendered) -> RunOutput:
        """Writes the JSON payload."""
        inp = rendered.inp
        encoding = time.time_ns()
        body = {
            "model": self.model_id,
            "prompt_sha256": hashlib.sha256(inp.prompt.encode()).hexdigest(),
            "params": inp.params,
            "steps": rendered.payload,
        }
        if inp.image is not None:  # the bytes the worker read: service tests see the image reached it
            body["image_sha256"] = hashlib.sha256(inp.image).hexdigest()
        data = json.dumps(body, sort_keys=True).encode()
        tracing.phase("encode", start_ns=encoding, end_ns=time.time_ns())
        return RunOutput(data, "application/json", "json", hashlib.sha256(data).hexdigest())


def python_runner(model_id: str, spec: ModelSpec, device: str) -> Any:
    """A 'python' model's runner: its factory ('module:callable') imported and called with (model_id, spec, device)."""
    module, _, name = (spec.factory or "").partition(":")
    factory = getattr(importlib.import_module(module), name)
    return factory(model_id, spec, device)


class DiffusersRunner:
    """A loaded text- or image-to-video pipeline (services.worker.inference.VideoPipeline) on one device."""

    def __init__(self, model_id: str, spec: ModelSpec, pipeline: Any, load_seconds: float = 0.0) -> None:
        self.model_id = model_id
        self.spec = spec
        self.pipeline = pipeline
        self.load_seconds = load_seconds  # reading the folder and placing it on its device (warm-up apart)

    @classmethod
    def load(cls, model_id: str, spec: ModelSpec, device: str) -> DiffusersRunner:
        """Loads the pipeline from the model's folder onto `device` and warms it once (blocking; call in a thread)."""
        from services.worker import inference

        if spec.path is None:
            raise ValueError(f"model {model_id!r} has no path")
        dtype = inference.resolve_dtype(spec.dtype, device)
        began = time.perf_counter()
        pipeline = inference.VideoPipeline.load(
            model_id, Path(spec.path), device, dtype, inference.LoadOptions.of(spec)
        )
        load_seconds = time.perf_counter() - began
        wrong = pipeline.needs.violations(spec)
        if wrong:
            raise ValueError(
                f"model {model_id!r}: its registry rules let through sizes the pipeline cannot make: {'; '.join(wrong)}"
            )
        # At the default request's shape, so a compiled transformer is compiled for the usual request before readiness.
        usual = videoparams.defaults(spec)
        seconds = pipeline.warmup(
            inference.GenerationRequest(
                prompt="warmup", num_frames=usual.num_frames, width=usual.width, height=usual.height,
                num_inference_steps=1, guidance_scale=usual.guidance_scale, fps=usual.fps, seed=0,
            )
        )
        log.info(
            "model loaded",
            extra={
                "model": model_id,
                "device": device,
                "dtype": str(dtype).removeprefix("torch."),
                "warmup_seconds": round(seconds, 3),
            },
        )
        if pipeline.not_resumable is not None:
            log.info("interrupted runs restart from step 0", extra={"model": model_id, "why": pipeline.not_resumable})
        return cls(model_id, spec, pipeline, load_seconds)

    @property
    def not_resumable(self) -> str | None:
        """Why an interrupted run of this model restarts from step 0 (None: it resumes from its newest checkpoint)."""
        return self.pipeline.not_resumable

    def render(self, inp: RunInput, on_step: OnStep, should_abort: ShouldAbort) -> Rendered:
        """Runs the pipeline with the task's parameters (and its input image, fitted to the frame size) to decoded
        frames, from the checkpoint `inp.resume` when it is one of this very request."""
        from services.worker import inference

        v = videoparams.stored(inp.params, self.spec)
        request = inference.GenerationRequest(
            prompt=inp.prompt,
            negative_prompt=v.negative_prompt,
            num_frames=v.num_frames,
            width=v.width,
            height=v.height,
            num_inference_steps=v.num_inference_steps,
            guidance_scale=v.guidance_scale,
            fps=v.fps,
            seed=v.seed,
            image=None if inp.image is None else self._fitted(inp.image, v.width, v.height),
        )
        video = self.pipeline.render(
            request, on_step, should_abort, resume=inp.resume, capture=inp.capture, preview=inp.previews
        )
        if inp.resume is not None and video.resumed_from != inp.resume.step:
            log.warning(
                "checkpoint not resumed: it is not this request's on this model; ran from step 0",
                extra={"task_id": str(inp.task_id), "model": self.model_id, "checkpoint_step": inp.resume.step},
            )
        return Rendered(inp, video)

    def _fitted(self, png: bytes, width: int, height: int) -> Any:
        """The stored canonical PNG as an RGB image of exactly width x height, fitted the model's way (image_fit)."""
        try:
            image = images.open_canonical(png)
        except (OSError, ValueError, SyntaxError) as exc:  # PIL's decode errors are OSErrors: not worth a retry here
            raise ValueError(f"the stored input image cannot be decoded ({type(exc).__name__}: {exc})") from exc
        return images.fit(image, width, height, self.spec.image_fit)

    def encode(self, rendered: Rendered) -> RunOutput:
        """The rendered frames as an MP4."""
        video = self.pipeline.encode(rendered.payload)
        return RunOutput(video.data, video.content_type, "mp4", video.sha256)


@dataclass(frozen=True, slots=True)
class DevicePlan:
    """A worker's devices (each runs one task's device phase at a time), how many tasks it runs at once, and whether
    it uses CUDA."""

    devices: list[str]
    slots: int
    use_cuda: bool
    capacity: float  # its share of the cluster-wide cap: devices x slots per device (the local slots are its ceiling)
    sequences: dict[str, int] = field(default_factory=dict)  # chat models: their own slots (sequences), within `slots`


UPSTREAM_DEVICE = "upstream"  # an upstream model's runner key: it uses none of this worker's devices


def device_plan(kinds: set[str], slots_setting: int, slots_per_device: float) -> DevicePlan:
    """The worker's devices and slots: ceil(devices x slots_per_device) tasks unless `slots_setting` says, and its
    capacity in the cluster-wide cap, devices x slots_per_device (or `slots_setting`) unrounded; imports torch only
    when a diffusers or transformers model is served. A 'sleep'-only worker needs no device: each slot gets a lane of
    its own. A chat ('transformers') model's slots are its sequences, added once it is loaded (with_sequences)."""
    if not kinds - {"openai-compatible"}:  # upstream models only: every slot is a request to one (with_sequences)
        return DevicePlan(["cpu"], 0, False, 0.0)
    if not kinds & {"diffusers", "transformers"}:
        slots = slots_setting or 1
        return DevicePlan(["cpu"] * slots, slots, False, float(slots))
    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    devices = [f"cuda:{i}" for i in range(count)] or ["cpu"]
    if not kinds - {"transformers"}:  # chat models only: every slot is a sequence
        return DevicePlan(devices, 0, count > 0, 0.0)
    capacity = float(slots_setting) if slots_setting else len(devices) * slots_per_device
    return DevicePlan(devices, slots_setting or math.ceil(capacity), count > 0, capacity)


def with_sequences(plan: DevicePlan, runners: dict[tuple[str, str], Any]) -> DevicePlan:
    """The plan with a slot for every sequence its chat runners run at once (each loaded model's max_sequences) and for
    every request its upstream models may have open (upstream_max_requests)."""
    from services.worker.chatrun import ChatRunner
    from services.worker.upstream import Upstream

    sequences: dict[str, int] = {}
    for (model_id, _), r in runners.items():
        if isinstance(r, ChatRunner):
            sequences[model_id] = sequences.get(model_id, 0) + r.spec.max_sequences
        elif isinstance(r, Upstream):
            sequences[model_id] = sequences.get(model_id, 0) + r.spec.upstream_max_requests
    total = sum(sequences.values())
    return DevicePlan(plan.devices, plan.slots + total, plan.use_cuda, plan.capacity + total, sequences)


def model_devices(model_id: str, spec: ModelSpec, devices: list[str]) -> list[str]:
    """The worker's devices this model may run on: its `gpus` among the CUDA ones (a CPU runs everything)."""
    allowed = [
        d
        for d in sorted(set(devices))
        if spec.gpus is None or not d.startswith("cuda") or int(d.partition(":")[2] or 0) in spec.gpus
    ]
    if not allowed:
        raise ValueError(
            f"model {model_id!r} may use GPUs {spec.gpus}, and this worker has {', '.join(sorted(set(devices)))}"
        )
    return allowed


def load_runners(models: dict[str, ModelSpec], devices: list[str]) -> dict[tuple[str, str], Any]:
    """One runner per (model, device) the model may use (blocking; call in a thread): a ModelRunner, for a chat model a
    chatrun.ChatRunner, for an upstream model one upstream.Upstream (on UPSTREAM_DEVICE)."""
    runners: dict[tuple[str, str], Any] = {}
    for model_id, spec in models.items():
        if spec.kind == "openai-compatible":  # no device here: the upstream server's own
            from services.worker.upstream import Upstream

            runners[(model_id, UPSTREAM_DEVICE)] = Upstream(model_id, spec)
            continue
        for device in model_devices(model_id, spec, devices):
            if spec.kind == "sleep":
                runners[(model_id, device)] = SleepRunner(model_id, spec)
            elif spec.kind == "python":
                runners[(model_id, device)] = python_runner(model_id, spec, device)
            elif spec.kind == "transformers":
                from services.worker.chatrun import ChatRunner

                runners[(model_id, device)] = ChatRunner.load(model_id, spec, device)
            else:
                runners[(model_id, device)] = DiffusersRunner.load(model_id, spec, device)
    return runners
