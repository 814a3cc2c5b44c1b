"""The run types every runner shares: what a slot hands a runner (RunInput), what the device phase leaves
(Rendered), what comes out (RunOutput), the ModelRunner protocol, and the failures a run raises on purpose.

Torch-free and import-free within the worker's model code, so runner.py, inference.py, chatrun.py and the engine all
import it and none of them imports another for a type.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from taskgate.store import TextOutcome

from .checkpoint import Capture, Snapshot

OnStep = Callable[[int, int], None]
ShouldAbort = Callable[[], bool]


class RunAborted(Exception):
    """The run stopped at a step boundary because its abort flag was set (a diffusers pipeline stays usable)."""


class InputMissing(Exception):
    """A task's input image is not in the result store (or is not what its sha256 says): no retry brings it back."""


class RunFailure(Exception):
    """A failure a runner raises with its own error code and whether a retry may help (a 'python' model's runner says
    so through it; any other exception is classified by its type, services.worker.runner.classify)."""

    def __init__(self, message: str, *, code: str, retryable: bool) -> None:
        super().__init__(message)
        self.code = code
        self.retryable = retryable


@dataclass(frozen=True, slots=True)
class RunInput:
    """One task's inputs as a runner sees them: `image` is the canonical PNG its params' "image" names, read from the
    result store before the run (None for a text-to-video task); `resume` the checkpoint an earlier attempt left (a
    runner that cannot use it starts from step 0), `capture` where the run's own snapshots go (None: none taken),
    `previews` where its preview frames go (a services.worker.partial.Partial; None: none made)."""

    task_id: int
    attempt: int
    prompt: str
    params: dict[str, Any]
    image: bytes | None = None
    resume: Snapshot | None = None
    capture: Capture | None = None
    previews: Any = None


@dataclass(frozen=True, slots=True)
class RunOutput:
    """An encoded output ready to store."""

    data: bytes
    content_type: str
    extension: str
    sha256: str
    text: TextOutcome | None = None  # a chat task's answer as its row records it


@dataclass(frozen=True, slots=True)
class Rendered:
    """A task's device phase done (a pipeline's decoded frames), its CPU phase (encoding) still to run."""

    inp: RunInput
    payload: object


class ModelRunner(Protocol):
    """Runs a task in two phases on the calling thread: the device phase (denoising, VAE decode; calls on_step after
    each step, raises RunAborted when told), exclusive on its device, then the CPU phase (encoding), which overlaps
    the next task's device phase."""

    model_id: str

    def render(self, inp: RunInput, on_step: OnStep, should_abort: ShouldAbort) -> Rendered:
        """The device phase of one task."""
        ...

    def encode(self, rendered: Rendered) -> RunOutput:
        """The CPU phase: the rendered task as an encoded output."""
        ...
