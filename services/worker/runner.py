"""Model runners: what a slot executes for one task, on its own thread (a diffusers pipeline or a 'sleep' stand-in)."""

from __future__ import annotations

import hashlib
import json
import logging
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from taskgate.config import ModelSpec

log = logging.getLogger("taskgate.worker.runner")

OnStep = Callable[[int, int], None]
ShouldAbort = Callable[[], bool]


class RunAborted(Exception):
    """The run stopped at a step boundary because its abort flag was set."""


class InjectedFailure(Exception):
    """A failure the 'sleep' model raises on purpose (ModelSpec.fail_times; tests and benchmarks only)."""

    def __init__(self, code: str, retryable: bool, attempt: int) -> None:
        super().__init__(f"injected failure on attempt {attempt}")
        self.code = code
        self.retryable = retryable


@dataclass(frozen=True, slots=True)
class RunInput:
    """One task's inputs as a runner sees them."""

    task_id: int
    attempt: int
    prompt: str
    params: dict[str, Any]


@dataclass(frozen=True, slots=True)
class RunOutput:
    """An encoded output ready to store."""

    data: bytes
    content_type: str
    extension: str
    sha256: str


class ModelRunner(Protocol):
    """Runs one task at a time on the calling thread; calls on_step after each step; raises RunAborted when told."""

    model_id: str

    def generate(self, inp: RunInput, on_step: OnStep, should_abort: ShouldAbort) -> RunOutput:
        """Runs one task to an encoded output."""
        ...


def classify(exc: BaseException) -> tuple[bool, str]:
    """(retryable, error_code) of a run's failure."""
    if isinstance(exc, InjectedFailure):
        return exc.retryable, exc.code
    inference = sys.modules.get("services.worker.inference")
    if inference is not None:  # only loaded when a diffusers model is served
        retryable, code = inference.classify(exc)
        return bool(retryable), str(code)
    if isinstance(exc, OSError | ConnectionError | TimeoutError):
        return True, "TRANSIENT_IO"
    if isinstance(exc, ValueError | TypeError):
        return False, "INVALID_PARAMETERS"
    return False, "PIPELINE_ERROR"


def _param(params: dict[str, Any], name: str, default: Any) -> Any:
    value = params.get(name)
    return default if value is None else value


class SleepRunner:
    """Holds a slot for `sleep_seconds`, one 'step' at a time, and returns a small deterministic JSON payload."""

    def __init__(self, model_id: str, spec: ModelSpec) -> None:
        self.model_id = model_id
        self.spec = spec
        self._idle = threading.Event()  # never set: its wait() is an interruptible sleep

    def generate(self, inp: RunInput, on_step: OnStep, should_abort: ShouldAbort) -> RunOutput:
        """Sleeps step by step, checking the abort flag between steps; fails on purpose when configured."""
        steps = max(1, int(_param(inp.params, "num_inference_steps", self.spec.default_steps)))
        per_step = self.spec.sleep_seconds / steps
        for step in range(1, steps + 1):
            if should_abort():
                raise RunAborted(f"aborted before step {step}")
            if per_step > 0:
                self._idle.wait(per_step)
            on_step(step, steps)
        if should_abort():
            raise RunAborted("aborted after the last step")
        if inp.attempt <= self.spec.fail_times:
            raise InjectedFailure(self.spec.fail_code, self.spec.fail_retryable, inp.attempt)
        body = {
            "model": self.model_id,
            "prompt_sha256": hashlib.sha256(inp.prompt.encode()).hexdigest(),
            "params": inp.params,
            "steps": steps,
        }
        data = json.dumps(body, sort_keys=True).encode()
        return RunOutput(data, "application/json", "json", hashlib.sha256(data).hexdigest())


class DiffusersRunner:
    """A loaded text-to-video pipeline (services.worker.inference.VideoPipeline) on one device."""

    def __init__(self, model_id: str, spec: ModelSpec, pipeline: Any) -> None:
        self.model_id = model_id
        self.spec = spec
        self.pipeline = pipeline

    @classmethod
    def load(cls, model_id: str, spec: ModelSpec, device: str) -> DiffusersRunner:
        """Loads the pipeline from the model's folder onto `device` and warms it once (blocking; call in a thread)."""
        from services.worker import inference

        if spec.path is None:
            raise ValueError(f"model {model_id!r} has no path")
        _, dtype = inference.pick_device()
        if device == "cpu":
            import torch

            dtype = torch.float32
        pipeline = inference.VideoPipeline.load(model_id, Path(spec.path), device, dtype)
        seconds = pipeline.warmup()
        log.info("model loaded", extra={"model": model_id, "device": device, "warmup_seconds": round(seconds, 3)})
        return cls(model_id, spec, pipeline)

    def generate(self, inp: RunInput, on_step: OnStep, should_abort: ShouldAbort) -> RunOutput:
        """Runs the pipeline with the task's parameters and returns the MP4."""
        from services.worker import inference

        p, s = inp.params, self.spec
        seed = p.get("seed")
        request = inference.GenerationRequest(
            prompt=inp.prompt,
            negative_prompt=str(_param(p, "negative_prompt", "")),
            num_frames=int(_param(p, "num_frames", s.default_frames)),
            width=int(_param(p, "width", s.default_width)),
            height=int(_param(p, "height", s.default_height)),
            num_inference_steps=int(_param(p, "num_inference_steps", s.default_steps)),
            guidance_scale=float(_param(p, "guidance_scale", s.default_guidance)),
            fps=int(_param(p, "fps", s.default_fps)),
            seed=None if seed is None else int(seed),
        )
        try:
            video = self.pipeline.generate(request, on_step, should_abort)
        except inference.InferenceAborted as exc:
            raise RunAborted(str(exc)) from exc
        return RunOutput(video.data, video.content_type, "mp4", video.sha256)


def device_plan(kinds: set[str], slots_setting: int) -> tuple[list[str], bool]:
    """The device of each slot and whether CUDA is used; imports torch only when a diffusers model is served."""
    if "diffusers" not in kinds:
        return ["cpu"] * (slots_setting or 1), False
    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count == 0:
        return ["cpu"] * (slots_setting or 1), False
    slots = slots_setting or count
    return [f"cuda:{i % count}" for i in range(slots)], True


def load_runners(models: dict[str, ModelSpec], devices: list[str]) -> dict[tuple[str, str], ModelRunner]:
    """One runner per (model, device) in use (blocking; call in a thread)."""
    runners: dict[tuple[str, str], ModelRunner] = {}
    for model_id, spec in models.items():
        for device in sorted(set(devices)):
            if spec.kind == "sleep":
                runners[(model_id, device)] = SleepRunner(model_id, spec)
            else:
                runners[(model_id, device)] = DiffusersRunner.load(model_id, spec, device)
    return runners
