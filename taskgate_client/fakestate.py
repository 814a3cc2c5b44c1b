"""The fake taskgate's tasks and how they run (see taskgate_client.testing, which users import): the outcomes a test
scripts, the model limits, the in-memory rows, their history and event log, the test's controls, the played worker."""

from __future__ import annotations

import asyncio
import hashlib
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import datetime, timedelta

import grpc
from google.protobuf import duration_pb2
from google.protobuf.message import Message
from google.protobuf.timestamp_pb2 import Timestamp
from google.rpc import error_details_pb2

from taskgate_api._compat import UTC
from taskgate_api.v1 import task_pb2
from taskgate_client.fakerpc import _info, _invalid, _not_found, rpc_error
from taskgate_client.types import Status, Task

TENANT = "fake-tenant"

START = datetime(2025, 1, 1, tzinfo=UTC)  # the fake clock's first reading; each change is one second later
CHUNK = 64 * 1024
CALLBACK_EVENTS = frozenset({"CANCELED", "OUTPUT", "PROGRESS"})
CHAT = "chat"


@dataclass(frozen=True, slots=True)
class Succeed:
    """The task runs, reports each `progress` percentage, and succeeds with `data` (None: bytes made from the
    prompt)."""

    data: bytes | None = None
    content_type: str = "video/mp4"
    progress: tuple[int, ...] = (50,)


@dataclass(frozen=True, slots=True)
class Fail:
    """The task runs and fails for good with `code` and `message`."""

    code: str = "MODEL_ERROR"
    message: str = "the model failed"
    progress: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class TimeOut:
    """The task runs past its processing timeout (TIMEOUT, error code PROCESSING_TIMEOUT)."""

    message: str = "the task ran past its processing timeout"


@dataclass(frozen=True, slots=True)
class StayQueued:
    """The task stays QUEUED until the test calls `server.finish()` or cancels it."""


Hold = StayQueued  # its name before #40 ('hold' is a soft-cancelled attempt keeping its lease): kept for existing tests


Outcome = Succeed | Fail | TimeOut | StayQueued
Script = Outcome | Callable[[Task], Outcome | None]  # a function's None means Succeed()
SUCCEED = Succeed()


@dataclass(frozen=True, slots=True)
class ModelLimits:
    """What the fake accepts for a model: the services' defaults for a model spec."""

    default_frames: int = 9
    default_width: int = 32
    default_height: int = 32
    default_steps: int = 4
    default_guidance: float = 5.0
    default_fps: int = 8
    max_frames: int = 81
    frame_step: int = 4
    max_size: int = 1280
    size_multiple: int = 16
    max_steps: int = 100
    max_guidance: float = 30.0
    max_fps: int = 60

@dataclass
class _Entry:
    task: task_pb2.Task
    fingerprint: str
    history: list[task_pb2.TaskEvent] = field(default_factory=list)
    data: bytes = b""
    output: list[tuple[int, task_pb2.OutputChunk]] = field(default_factory=list)  # (the version it came after, chunk)


def _ts(at: datetime) -> Timestamp:
    ts = Timestamp()
    ts.FromDatetime(at)
    return ts


_IMAGE_SIGNATURES = (b"\x89PNG\r\n\x1a\n", b"\xff\xd8\xff")  # PNG, JPEG; WebP is RIFF....WEBP


class FakeTaskgateState:
    """The fake's tasks, their history and the test's controls; FakeTaskgate (taskgate_client.testing) serves them."""

    def __init__(
        self,
        *,
        outcome: Script = SUCCEED,
        models: Iterable[str] = ("wan-tiny",),
        default_model: str = "wan-tiny",
        limits: ModelLimits | None = None,
        max_pending: int | None = None,
        image_models: Iterable[str] = (),
        gpu_seconds_per_day: float | None = None,
        gpu_seconds_per_task: float = 60.0,
        chat_models: Iterable[str] = ("llama-tiny",),
        tokens_per_day: int | None = None,
    ) -> None:
        self.outcome = outcome
        self.image_models = tuple(image_models)
        """Models that serve image-to-video (the others serve text-to-video); the fake decodes no image: it checks
        the file's signature and names an input by the sha256 of the bytes sent (of the URL, which it never fetches)."""
        self.chat_models = tuple(chat_models)
        """Models that serve chat tasks: a succeeded one answers with deterministic text (or Succeed's `data`), its
        tokens counted as words (the fake has no tokenizer)."""
        self.models = (*models, *self.image_models, *self.chat_models)
        self._uploads: set[str] = set()
        self._texts: dict[str, str] = {}  # text attachments by sha256
        self.default_model = default_model
        self.limits = limits or ModelLimits()
        self.max_pending = max_pending
        self.gpu_seconds_per_day = gpu_seconds_per_day
        """A GPU-second budget as the server keeps one: each new task reserves `gpu_seconds_per_task` (a task cancelled
        before it ran releases it), and one that does not fit is refused QUOTA_EXCEEDED with RetryInfo until the fake
        clock's next midnight. The fake's budget never resets and measures nothing: every task costs its estimate."""
        self.gpu_seconds_per_task = gpu_seconds_per_task
        self.tokens_per_day = tokens_per_day
        """A token budget as the server keeps one: a chat task reserves its input (words) and its max_output_tokens
        while it is unfinished, is trued up to the tokens it used when it succeeds and releases them otherwise; one that
        does not fit is refused QUOTA_EXCEEDED (metadata budget 'tokens') with RetryInfo until the fake clock's next
        midnight. The fake's budget never resets."""
        self._tasks: dict[int, _Entry] = {}
        self._keys: dict[tuple[str, str], int] = {}  # (end user, key): keys are each end user's own
        self._log: list[task_pb2.TaskEvent] = []
        self._sequence = 0  # the output stream's last sequence (one stream for every task, as TASK_OUTPUT)
        self._ticks = 0
        self._failures: dict[str, list[grpc.aio.AioRpcError]] = {}
        self._changed = asyncio.Event()
        self._loop: asyncio.AbstractEventLoop | None = None

    # -- the test's controls -------------------------------------------------------------------------------------

    def tasks(self) -> list[Task]:
        """Every task submitted so far, in submission order, as it is now."""
        return [Task.from_proto(self._copy(entry.task)) for _, entry in sorted(self._tasks.items())]

    def finish(self, task_id: str, outcome: Succeed | Fail | TimeOut = SUCCEED) -> Task:
        """Runs a waiting (CREATED or QUEUED) task to `outcome` now; a task that already ran is returned as it is."""
        entry = self._tasks[int(task_id)]
        if entry.task.status in (task_pb2.TASK_STATUS_CREATED, task_pb2.TASK_STATUS_QUEUED):
            self._run(entry, outcome)
        return Task.from_proto(self._copy(entry.task))

    def fail_next(
        self,
        rpc: str,
        code: grpc.StatusCode,
        message: str = "injected",
        *,
        reason: str = "",
        retry_delay: float | None = None,
    ) -> None:
        """The next call of `rpc` (e.g. "SubmitTask") fails with `code`; call it again to queue more failures."""
        details: list[Message] = [_info(reason or code.name)]
        if retry_delay is not None:
            delay = duration_pb2.Duration()
            delay.FromNanoseconds(int(retry_delay * 1e9))
            details.append(error_details_pb2.RetryInfo(retry_delay=delay))
        self._failures.setdefault(rpc, []).append(rpc_error(code, message, *details))

    # -- plumbing ------------------------------------------------------------------------------------------------

    def _injected(self, rpc: str) -> None:
        queued = self._failures.get(rpc)
        if queued:
            raise queued.pop(0)

    def _now(self) -> datetime:
        self._ticks += 1
        return START + timedelta(seconds=self._ticks)

    def _notify(self) -> None:
        """Wakes every stream waiting for a change (from any thread)."""
        changed, self._changed = self._changed, asyncio.Event()
        loop = self._loop
        try:
            here = asyncio.get_running_loop()
        except RuntimeError:
            here = None
        if loop is not None and loop is not here and loop.is_running():
            loop.call_soon_threadsafe(changed.set)
        else:
            changed.set()

    async def _changes(self, seen: int) -> None:
        """Returns once the log holds more than `seen` events."""
        self._loop = asyncio.get_running_loop()
        while True:
            changed = self._changed  # taken before the check, so a change made after it still wakes us
            if len(self._log) > seen:
                return
            await changed.wait()

    def _entry(self, task_id: str) -> _Entry:
        if not task_id.isdigit():
            raise _invalid([("task_id", "must be a decimal task id")])
        entry = self._tasks.get(int(task_id))
        if entry is None:
            raise _not_found()
        return entry

    def _copy(self, task: task_pb2.Task, *, position: bool = False) -> task_pb2.Task:
        out = task_pb2.Task()
        out.CopyFrom(task)
        if position and task.status == task_pb2.TASK_STATUS_QUEUED:
            ahead = [
                e.task
                for e in self._tasks.values()
                if e.task.status == task_pb2.TASK_STATUS_QUEUED and e.task.model_id == task.model_id
                and (-e.task.priority, int(e.task.id)) < (-task.priority, int(task.id))
            ]
            out.queue_position = len(ahead) + 1
        return out

    def _move(
        self,
        entry: _Entry,
        to: Status,
        *,
        reason: str,
        actor: str,
        progress: int | None = None,
        error: tuple[str, str] | None = None,
        result: task_pb2.TaskResult | None = None,
    ) -> None:
        """One state change: the row, its history and the tenant's event log, as the services' trigger records it."""
        task = entry.task
        before = task.status
        now = _ts(self._now())
        task.status = to.to_proto()
        task.version += 1
        task.updated_at.CopyFrom(now)
        if to is Status.QUEUED:
            task.queued_at.CopyFrom(now)
        if to is Status.PROCESSING and before != task.status:
            task.attempt += 1
            task.worker_id = "fake-worker"
            task.started_at.CopyFrom(now)
        if progress is not None:
            task.progress = progress
        if error is not None:
            task.error_code, task.error_message = error
        if result is not None:
            task.result.CopyFrom(result)
        if to.terminal:
            task.finished_at.CopyFrom(now)
        event = task_pb2.TaskEvent(
            task_id=task.id,
            user_id=task.user_id,
            model_id=task.model_id,
            version=task.version,
            to_status=task.status,
            progress=task.progress,
            error_code=task.error_code,
            error_message=task.error_message,
            attempt=task.attempt,
            worker_id=task.worker_id,
            reason=reason,
            actor=actor,
            event_id=len(self._log) + 1,
        )
        if before != task_pb2.TASK_STATUS_UNSPECIFIED:
            event.from_status = before
        event.at.CopyFrom(now)
        if result is not None:
            event.result.CopyFrom(result)
        entry.history.append(event)
        self._log.append(event)
        self._notify()

    def _run(self, entry: _Entry, outcome: Outcome) -> None:
        """Plays the worker: claim, progress, then the outcome's end."""
        if isinstance(outcome, StayQueued):
            return
        self._move(entry, Status.PROCESSING, reason="claimed", actor="worker", progress=0)
        for pct in outcome.progress if not isinstance(outcome, TimeOut) else ():
            self._move(entry, Status.PROCESSING, reason="progress", actor="worker", progress=pct)
        if isinstance(outcome, Succeed):
            task = entry.task
            chat = task.task_type == CHAT
            entry.data = (
                outcome.data if outcome.data is not None else (self._answer(task) if chat else self._video(task))
            )
            if chat:
                text = entry.data.decode(errors="replace")
                self._stream_text(entry, text)
                task.text.CopyFrom(task_pb2.TextResult(text=text, finish_reason="stop", chars=len(text)))
                task.usage.output_tokens = len(text.split())
            result = task_pb2.TaskResult(
                uri=f"fake://results/{task.id}-a{task.attempt}.{'txt' if chat else 'mp4'}",
                content_type="text/plain; charset=utf-8" if chat and outcome.data is None else outcome.content_type,
                size_bytes=len(entry.data),
                sha256=hashlib.sha256(entry.data).hexdigest(),
            )
            self._move(entry, Status.SUCCEEDED, reason="succeeded", actor="worker", progress=100, result=result)
        elif isinstance(outcome, Fail):
            self._move(entry, Status.FAILED, reason="failed", actor="worker", error=(outcome.code, outcome.message))
        else:
            self._move(
                entry,
                Status.TIMEOUT,
                reason="processing timeout",
                actor="scheduler",
                error=("PROCESSING_TIMEOUT", outcome.message),
            )

    def _stream_text(self, entry: _Entry, text: str) -> None:
        """Plays the worker's streamed output: the answer in word-sized chunks, as a real stream carries them."""
        offset = 0
        for piece in re.findall(r"\S+\s*|\s+", text):
            self._sequence += 1
            chunk = task_pb2.OutputChunk(
                task_id=entry.task.id, attempt=max(1, entry.task.attempt), kind=task_pb2.OUTPUT_KIND_TEXT, text=piece,
                offset=offset, sequence=self._sequence,
            )
            chunk.at.CopyFrom(_ts(self._now()))
            entry.output.append((entry.task.version, chunk))
            offset += len(piece)

    @staticmethod
    def _answer(task: task_pb2.Task) -> bytes:
        """A chat task's deterministic stand-in answer: the same request gives the same text."""
        digest = hashlib.sha256(f"{task.model_id}\n{task.prompt}\n{task.chat.seed}".encode()).hexdigest()
        return f"A fake answer to {task.prompt[:40]!r} ({digest[:12]}).".encode()

    @staticmethod
    def _video(task: task_pb2.Task) -> bytes:
        """Deterministic stand-in bytes: the same request gives the same output."""
        digest = hashlib.sha256(
            f"{task.model_id}\n{task.prompt}\n{task.params.seed}\n{task.image.sha256}".encode()
        ).digest()
        return b"FAKE-MP4\n" + digest * 8

    def _autorun(self, entry: _Entry) -> None:
        if entry.task.status in (task_pb2.TASK_STATUS_CREATED, task_pb2.TASK_STATUS_QUEUED):
            script = self.outcome
            outcome = script(Task.from_proto(self._copy(entry.task))) if callable(script) else script
            self._run(entry, outcome or SUCCEED)
