"""Step checkpoints of a diffusers run: what a later attempt needs to resume mid-schedule (the latents after a step,
the step count, the generator's state), when to take one, and how it is encoded (safetensors: tensors and a few
strings, no pickle).

A run takes a snapshot on its device thread at a step end when `Capture.due` says so (a copy of the latents to host
memory, nothing more); encoding and storing happen off that thread (services/worker/resume.py). A resumed run
is exactly the rest of the uninterrupted one only where each step depends on nothing but the latents, the step index
and the generator: `not_resumable` names what breaks that (a multistep or stochastic scheduler), and such a family
restarts from step 0.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

FORMAT = "taskgate-checkpoint-1"
LATENTS = "latents"
GENERATOR = "generator"

# Schedulers whose step reads only (model output, timestep, sample) and the schedule itself: resuming from saved
# latents at step k with the schedule's index at k gives the very same steps. Others keep history between steps
# (multistep solvers' previous outputs) or draw noise per step in ways a restored generator may not cover.
RESUMABLE_SCHEDULERS = frozenset({"FlowMatchEulerDiscreteScheduler", "CogVideoXDDIMScheduler", "DDIMScheduler"})


def not_resumable(pipe: Any, accepts: set[str] | None = None) -> str | None:
    """Why a run of this pipeline cannot resume from a checkpoint (None: it can)."""
    scheduler = getattr(pipe, "scheduler", None)
    name = type(scheduler).__name__
    if name not in RESUMABLE_SCHEDULERS:
        return f"its scheduler {name} keeps state between steps that a checkpoint does not hold"
    config = getattr(scheduler, "config", None)
    if getattr(config, "stochastic_sampling", False):
        return f"its scheduler {name} samples stochastically"
    if accepts is not None and not {"latents", "callback_on_step_end"} <= accepts:
        return f"{type(pipe).__name__} takes no latents or callback_on_step_end"
    return None


@dataclass(frozen=True)
class Snapshot:
    """A run after `step` of `total` steps: its tensors (on the host) and the fingerprint of the request and model that
    made them, so a checkpoint is never applied to another request or another model."""

    step: int
    total: int
    fingerprint: str
    tensors: dict[str, Any] = field(repr=False)  # torch tensors on the CPU: the latents, the generator's state

    def encode(self) -> bytes:
        """As a safetensors file (blocking: call it off the device thread and off the event loop)."""
        from safetensors.torch import save

        meta = {"format": FORMAT, "step": str(self.step), "total": str(self.total), "fingerprint": self.fingerprint}
        return save({k: v.contiguous() for k, v in self.tensors.items()}, metadata=meta)


class BadCheckpoint(ValueError):
    """Stored bytes that are not a checkpoint this worker can read."""


def decode(data: bytes) -> Snapshot:
    """A stored checkpoint; raises BadCheckpoint for anything else."""
    import json
    import struct

    from safetensors.torch import load

    try:
        (length,) = struct.unpack("<Q", data[:8])
        meta = json.loads(data[8 : 8 + length]).get("__metadata__") or {}
        if meta.get("format") != FORMAT:
            raise BadCheckpoint(f"format {meta.get('format')!r}")
        tensors = load(data)
        return Snapshot(int(meta["step"]), int(meta["total"]), str(meta["fingerprint"]), tensors)
    except BadCheckpoint:
        raise
    except Exception as exc:  # truncated, corrupt, another format: a checkpoint that cannot be used
        raise BadCheckpoint(f"{type(exc).__name__}: {exc}") from exc


@dataclass(frozen=True, slots=True)
class Policy:
    """When a run takes a checkpoint: every `every_seconds` of its device time, or every `every_steps` steps (0: not
    by that measure); both 0: never (a stop still takes one when asked)."""

    every_seconds: float = 30.0
    every_steps: int = 0

    @property
    def enabled(self) -> bool:
        return self.every_seconds > 0 or self.every_steps > 0


class Capture(Protocol):
    """What a run's device thread asks at each step end (both cheap, both thread-safe)."""

    def due(self, step: int, total: int) -> bool:
        """Whether to take a snapshot after `step` of `total` (never after the last)."""
        ...

    def keep(self, snapshot: Snapshot) -> None:
        """Hands a snapshot over to be stored (returns at once)."""
        ...


class Timer:
    """The due-ness half of a Capture: the policy against the steps and device seconds since the last snapshot, and
    a stop that asks for one at the next step end (a drain, a preemption)."""

    def __init__(self, policy: Policy, start_step: int = 0) -> None:
        self.policy = policy
        self._since = time.monotonic()  # the device phase starts about now; a snapshot restarts the count
        self._last_step = start_step
        self._stop = threading.Event()

    def ask_on_stop(self) -> None:
        """The next step end takes a snapshot whatever the policy says."""
        self._stop.set()

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    def due(self, step: int, total: int) -> bool:
        if step >= total or step <= self._last_step:
            return False
        if self._stop.is_set():
            return True
        p = self.policy
        by_steps = p.every_steps > 0 and step - self._last_step >= p.every_steps
        by_time = p.every_seconds > 0 and time.monotonic() - self._since >= p.every_seconds
        return by_steps or by_time

    def taken(self, step: int) -> None:
        self._last_step = step
        self._since = time.monotonic()
