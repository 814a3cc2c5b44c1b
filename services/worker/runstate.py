"""A claimed attempt's state on this worker (Run): what stopped it (a Halt of the worker's, or its row's Step), the
flags its device thread and the loop read, its progress and when it is due to be written, its device seconds and what
its final write meters.
"""

from __future__ import annotations

import asyncio
import enum
import threading
import time
from collections.abc import Awaitable
from dataclasses import dataclass, field
from typing import TypeVar

from nats.aio.msg import Msg

from services.worker import resume
from services.worker import runner as runmod
from services.worker.fetch import SlotTicket
from services.worker.settle import MessageAction, Step
from taskgate import store, telemetry
from taskgate.model import TaskRow
from taskgate.waiting import Interrupted, unless

T = TypeVar("T")


class Halt(enum.Enum):
    """A stop that does not come from the task row."""

    DRAIN = "drain"  # this worker is shutting down: release the task, nak
    PREEMPT = "preempt"  # a waiting task of higher priority needs the slot: checkpoint, release, keep the queue place
    KILLED = "killed"  # a simulated crash: touch nothing


@dataclass(eq=False)
class Run:
    """One claimed attempt running here."""

    task: TaskRow
    msg: Msg
    ticket: SlotTicket
    abort: threading.Event = field(default_factory=threading.Event)  # the device phase's thread looks at it each step
    halted: asyncio.Event = field(default_factory=asyncio.Event)  # the same, for what the run awaits on the loop
    stopped_by: Step | Halt | None = None
    steps_at_abort: int | None = None
    soft_canceled: bool = False
    finishing: bool = False
    steps_done: int = 0
    total_steps: int = 0
    reached: int = 0  # the newest step its device thread reported (written there; steps_done follows on the loop)
    written: int = 0  # the progress last sent (the claim wrote 0)
    published_step: int = 0  # the step last published live (live.py)
    last_write: float = field(default_factory=time.monotonic)  # when it was sent (monotonic)
    writing: asyncio.Event | None = None  # set once the beat statement carrying its latest progress has ended
    started: float = field(default_factory=time.monotonic)
    device_seconds: float = 0.0  # how long it has held a device (phases ended)
    held_since: float | None = None  # when its current device phase began (None: it holds no device)
    keeper: resume.Keeper | None = None  # its step checkpoints (None: its model takes none)
    kept_seconds: float = 0.0  # a chat run's device seconds when its newest published text was made (a resume's start)

    def device_seconds_now(self) -> float:
        """Its device seconds including the phase under way (read from the device thread too)."""
        since = self.held_since
        return self.device_seconds + (time.monotonic() - since if since is not None else 0.0)

    def metered(self, *, interrupted: bool = False) -> store.Metered:
        """This attempt's seconds so far, as its final write records them; an `interrupted` attempt (retried, released)
        counts its device seconds up to its newest checkpoint (a chat run's: up to its newest published text), the rest
        are wasted: the next attempt computes those steps again (all of them when it took none)."""
        slot = time.monotonic() - self.started
        if not interrupted:
            return store.Metered(self.device_seconds, slot)
        newest = self.keeper.newest if self.keeper is not None else None
        counted = min(newest.device_seconds if newest is not None else self.kept_seconds, self.device_seconds)
        wasted = self.device_seconds - counted
        telemetry.WASTED_GPU_SECONDS.labels(self.task.model_id).inc(wasted)
        return store.Metered(counted, slot, wasted)

    @property
    def attempt(self) -> int:
        """This run's fencing token: every write it makes is guarded by it."""
        return self.task.attempt

    @property
    def percent(self) -> int:
        """Progress of the denoising loop; 100 is kept for the finished task."""
        return min(99, self.steps_done * 100 // self.total_steps) if self.total_steps else 0

    @property
    def owns_message(self) -> bool:
        """False once the message is another attempt's (the task was taken over) or nobody's (a crash)."""
        stop = self.stopped_by
        return not (stop is Halt.KILLED or (isinstance(stop, Step) and stop.action is MessageAction.NOTHING))

    def stop(self, reason: Step | Halt) -> None:
        """Asks the run to stop at its next step; the first reason wins. A drained or preempted run that takes
        checkpoints takes one at that step, so its next attempt resumes there."""
        if reason in (Halt.DRAIN, Halt.PREEMPT) and self.stopped_by is None and self.keeper is not None:
            self.keeper.ask_on_stop()  # before the abort flag: the device thread reads that flag first
        if self.stopped_by is None:
            self.stopped_by = reason
            self.steps_at_abort = max(self.steps_done, self.reached)
        self.abort.set()
        self.halted.set()

    async def unless_stopped(self, work: Awaitable[T]) -> T:
        """`work`'s result, or RunAborted (with `work` cancelled) once the run is stopped first: a store read or a wait
        for a device never keeps a stopped run, or a draining worker, waiting."""
        halted = asyncio.ensure_future(self.halted.wait())
        try:
            return await unless(halted, work)
        except Interrupted:
            raise runmod.RunAborted(f"stopped ({self.stopped_by}) while waiting") from None
        finally:
            halted.cancel()

    def progress_pending(self) -> bool:
        """Whether it has progress not yet written that a write may still carry (the final transition writes 100)."""
        if self.finishing or self.soft_canceled or self.stopped_by is not None:
            return False
        return self.steps_done < self.total_steps and self.percent > self.written

    def progress_at(self, interval: float) -> float | None:
        """When its pending progress may be written (monotonic): `interval` after the last write; None: nothing to."""
        return self.last_write + interval if self.progress_pending() else None

    async def end_progress(self) -> None:
        """Stops progress writes before a final transition, so none lands after it."""
        self.finishing = True
        if self.writing is not None:
            await self.writing.wait()
