"""The 'sleep' stand-in with the faults the suites and the bench inject, as a 'python' model (ModelSpec.factory):
production code holds no test hook, a test's model names this module's `runner` as its factory.

`spec(...)` makes the ModelSpec: with no fault it is the plain 'sleep' model; with any (fail_times, kill_on_prompt,
encode_seconds) a 'python' model whose options carry them, run by `FaultySleepRunner` on the worker (a worker started
as a process imports this module: the checkout is on its PYTHONPATH).
"""

from __future__ import annotations

import logging
import os
import signal
import time
from dataclasses import dataclass
from typing import Any

from services.worker.runner import SleepRunner
from services.worker.runtypes import OnStep, Rendered, RunFailure, RunInput, RunOutput, ShouldAbort
from taskgate.config import ModelSpec

log = logging.getLogger("taskgate.worker.runner")
FACTORY = f"{__name__}:runner"


class InjectedFailure(RunFailure):
    """A failure the stand-in raises on purpose (Faults.fail_times)."""

    def __init__(self, code: str, retryable: bool, attempt: int) -> None:
        super().__init__(f"injected failure on attempt {attempt}", code=code, retryable=retryable)


@dataclass(frozen=True, slots=True)
class Faults:
    """What the stand-in does on purpose: attempts 1..fail_times of every task fail (fail_code, fail_retryable); a
    prompt containing kill_on_prompt SIGKILLs the worker after its first step (like an OOM kill: nothing is released);
    encode_seconds of CPU phase after the device phase (as MP4 encoding)."""

    fail_times: int = 0
    fail_code: str = "INJECTED_FAILURE"
    fail_retryable: bool = True
    kill_on_prompt: str | None = None
    encode_seconds: float = 0.0


FAULTS = frozenset(Faults.__dataclass_fields__)


class FaultySleepRunner(SleepRunner):
    """SleepRunner plus the spec's Faults (ModelSpec.options)."""

    def __init__(self, model_id: str, spec: ModelSpec) -> None:
        super().__init__(model_id, spec)
        self.faults = Faults(**spec.options)

    def render(self, inp: RunInput, on_step: OnStep, should_abort: ShouldAbort) -> Rendered:
        poison = self.faults.kill_on_prompt

        def stepped(step: int, steps: int) -> None:
            on_step(step, steps)
            if poison and poison in inp.prompt:
                log.warning("killing this worker process: a poison prompt", extra={"task_id": str(inp.task_id)})
                os.kill(os.getpid(), signal.SIGKILL)

        rendered = super().render(inp, stepped, should_abort)
        if inp.attempt <= self.faults.fail_times:
            raise InjectedFailure(self.faults.fail_code, self.faults.fail_retryable, inp.attempt)
        return rendered

    def encode(self, rendered: Rendered) -> RunOutput:
        if self.faults.encode_seconds > 0:
            time.sleep(self.faults.encode_seconds)
        return super().encode(rendered)


def runner(model_id: str, spec: ModelSpec, device: str) -> FaultySleepRunner:
    """The factory a 'python' ModelSpec names (FACTORY)."""
    return FaultySleepRunner(model_id, spec)


def spec(sleep_seconds: float = 0.0, **fields: Any) -> ModelSpec:
    """The stand-in's ModelSpec: `fields` are ModelSpec fields and Faults; any fault makes it a 'python' model."""
    faults = {name: fields.pop(name) for name in FAULTS & fields.keys()}
    if not faults:
        return ModelSpec(kind="sleep", sleep_seconds=sleep_seconds, **fields)
    return ModelSpec(kind="python", factory=FACTORY, options=faults, sleep_seconds=sleep_seconds, **fields)
