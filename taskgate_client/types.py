"""What the SDK returns: plain, typed views of the wire messages (the message itself stays in `.proto`)."""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, TypedDict

from google.protobuf.timestamp_pb2 import Timestamp

from taskgate_api._compat import UTC
from taskgate_api.status import Status as Status  # the wire enum, shared with the server
from taskgate_api.v1 import task_pb2

ImageSource = str | os.PathLike[str] | bytes
"""An input image for submit(): a file's path, an https URL (the gateway fetches it), or the file's bytes."""


class SubmitOptions(TypedDict, total=False):
    """The keyword options of submit(), so run() and the blocking client take them with the same types."""

    frames: int | None
    width: int | None
    height: int | None
    steps: int | None
    guidance: float | None
    fps: int | None
    seed: int | None
    negative_prompt: str
    priority: str | int
    idempotency_key: str | None
    callback_url: str | None
    callback_events: Iterable[str]
    metadata: Mapping[str, str] | None
    max_retries: int | None
    task_type: str | None
    image: ImageSource | None
    start_after: datetime | None
    max_queue_seconds: float | None
    end_user: str | None


CHAT = "chat"  # the task type of text generation
ChatInput = str | Sequence[Mapping[str, str]]  # one user message, or the conversation's {"role", "content"} dicts
# (a dict may name an uploaded text attachment as "content_sha256": the gateway appends its text to the content)


class ChatOptions(TypedDict, total=False):
    """The keyword options of chat(), for the asyncio and the blocking client alike."""

    system: str | None
    max_output_tokens: int | None
    temperature: float | None
    top_p: float | None
    stop: Iterable[str]
    seed: int | None
    priority: str | int
    idempotency_key: str | None
    callback_url: str | None
    callback_events: Iterable[str]
    metadata: Mapping[str, str] | None
    max_retries: int | None
    start_after: datetime | None
    max_queue_seconds: float | None
    end_user: str | None


class SubmitItem(SubmitOptions, total=False):
    """One task of submit_many: submit()'s prompt and model beside its options (a JSON line of `taskgate submit
    --file`)."""

    prompt: str
    model: str | None


PRIORITIES: dict[str, task_pb2.Priority.ValueType] = {
    "low": task_pb2.PRIORITY_LOW,
    "normal": task_pb2.PRIORITY_NORMAL,
    "high": task_pb2.PRIORITY_HIGH,
}
_PRIORITY_NAMES = {v: k for k, v in PRIORITIES.items()}


def priority_value(priority: str | int) -> task_pb2.Priority.ValueType:
    """'low' | 'normal' | 'high' (or the wire number) as the wire enum."""
    if isinstance(priority, int):
        if priority not in _PRIORITY_NAMES:
            raise ValueError(f"unknown priority {priority}")
        return priority  # type: ignore[return-value]
    try:
        return PRIORITIES[priority.lower()]
    except KeyError:
        raise ValueError(f"priority must be one of {', '.join(PRIORITIES)}, not {priority!r}") from None


def _time(msg: Any, name: str) -> datetime | None:
    if not msg.HasField(name):
        return None
    ts: Timestamp = getattr(msg, name)
    return ts.ToDatetime(tzinfo=UTC)


def _status(value: int) -> Status | None:
    return None if value == task_pb2.TASK_STATUS_UNSPECIFIED else Status.from_proto(value)


def _json_value(value: object) -> object:
    if isinstance(value, datetime):
        return value.isoformat()
    if isinstance(value, Status):
        return value.value
    if isinstance(value, TaskResult | InputImage | TextAnswer):
        return value.to_dict()
    return value


@dataclass(frozen=True, slots=True)
class TaskResult:
    """Where a finished task's output lives, with its size and sha256; `url` is a download URL valid until
    `url_expires_at` (S3 result store only), `deleted_at` when retention deleted the output."""

    uri: str
    content_type: str
    size_bytes: int
    sha256: str
    url: str = ""
    url_expires_at: datetime | None = None
    deleted_at: datetime | None = None

    @classmethod
    def from_proto(cls, msg: task_pb2.TaskResult) -> TaskResult:
        return cls(
            msg.uri, msg.content_type, msg.size_bytes, msg.sha256, msg.url, _time(msg, "url_expires_at"),
            _time(msg, "deleted_at"),
        )

    def to_dict(self) -> dict[str, object]:
        out: dict[str, object] = {
            "uri": self.uri, "content_type": self.content_type, "size_bytes": self.size_bytes, "sha256": self.sha256
        }
        if self.url:
            out["url"] = self.url
        return out


@dataclass(frozen=True, slots=True)
class TextAnswer:
    """A finished chat task's answer as GetTask carries it: the text (its beginning when `truncated`: the whole of it
    is the task's result, `download`), why generation ended ("stop" or "length") and its length in characters."""

    text: str
    truncated: bool
    finish_reason: str
    chars: int

    @classmethod
    def from_proto(cls, msg: task_pb2.TextResult) -> TextAnswer:
        return cls(msg.text, msg.truncated, msg.finish_reason, msg.chars)

    def to_dict(self) -> dict[str, object]:
        return {
            "text": self.text,
            "truncated": self.truncated,
            "finish_reason": self.finish_reason,
            "chars": self.chars,
        }


@dataclass(frozen=True, slots=True)
class InputImage:
    """An input image as the gateway stored it: a canonical RGB PNG named by its sha256 (what makes two requests the
    same); `source_format` is what was sent (UploadInput's answer only)."""

    sha256: str
    width: int
    height: int
    size_bytes: int
    source_format: str = ""

    @classmethod
    def from_proto(cls, msg: task_pb2.InputImage) -> InputImage:
        return cls(msg.sha256, msg.width, msg.height, msg.size_bytes, msg.source_format)

    def to_dict(self) -> dict[str, object]:
        return {"sha256": self.sha256, "width": self.width, "height": self.height, "size_bytes": self.size_bytes}


@dataclass(frozen=True, slots=True)
class InputText:
    """A text attachment as the gateway stored it (UploadInput, text/plain): a chat message names it by sha256
    (`{"role": "user", "content": "...", "content_sha256": t.sha256}`) and the gateway appends its text."""

    sha256: str
    size_bytes: int
    chars: int

    @classmethod
    def from_proto(cls, msg: task_pb2.InputText) -> InputText:
        return cls(msg.sha256, msg.size_bytes, msg.chars)


@dataclass(frozen=True, slots=True)
class Task:
    """A task as the gateway reports it."""

    task_id: str
    status: Status
    progress: int
    queue_position: int
    model_id: str
    task_type: str
    prompt: str
    priority: str
    version: int
    attempt: int
    retry_count: int
    max_retries: int
    error_code: str
    error_message: str
    result: TaskResult | None
    result_reused: bool
    idempotency_key: str
    callback_url: str
    callback_status: str
    worker_id: str
    metadata: dict[str, str]
    params: dict[str, object]
    created_at: datetime | None
    queued_at: datetime | None
    started_at: datetime | None
    finished_at: datetime | None
    updated_at: datetime | None
    proto: task_pb2.Task = field(repr=False, compare=False)
    created: bool | None = None
    """From submit only: False when an existing task was returned for the idempotency key."""
    estimated_start: datetime | None = None
    """When a QUEUED task should start (GetTask, watch); None without recent history of its model and size."""
    estimated_finish: datetime | None = None
    """When a QUEUED or PROCESSING task should finish (GetTask, watch); None without recent history."""
    image: InputImage | None = None
    """Image-to-video: the input image the task runs from."""
    replay_of: str | None = None
    """The FAILED or TIMEOUT task an operator replayed as this one."""
    start_after: datetime | None = None
    """Asked for at submission: no worker takes the task before it."""
    max_queue_seconds: float | None = None
    """Asked for at submission: its queue TTL (TIMEOUT QUEUE_TTL_EXPIRED when no worker took it in time)."""
    queue_expires_at: datetime | None = None
    """When the task, still waiting, ends TIMEOUT QUEUE_TTL_EXPIRED (with max_queue_seconds)."""
    end_user: str = ""
    """The tenant's own user the task was submitted for ('': the tenant itself)."""
    answer: TextAnswer | None = None
    """A SUCCEEDED chat task's answer (inline up to the gateway's size setting; `download` gives it all)."""
    input_tokens: int = 0
    """A chat task's input tokens, as its model's tokenizer counts them."""
    output_tokens: int = 0
    """A chat task's generated tokens."""

    @property
    def terminal(self) -> bool:
        """Whether the task has finished (SUCCEEDED, FAILED, TIMEOUT or CANCELED)."""
        return self.status.terminal

    @classmethod
    def from_proto(cls, msg: task_pb2.Task, created: bool | None = None) -> Task:
        p = msg.params
        c = msg.chat
        params: dict[str, object] = {
            "max_output_tokens": c.max_output_tokens,
            "temperature": round(c.temperature, 6),
            "top_p": round(c.top_p, 6),
            "stop": list(c.stop),
            "seed": c.seed if c.HasField("seed") else None,
        } if msg.HasField("chat") else {
            "num_frames": p.num_frames,
            "width": p.width,
            "height": p.height,
            "num_inference_steps": p.num_inference_steps,
            "guidance_scale": round(p.guidance_scale, 6),
            "fps": p.fps,
            "seed": p.seed if p.HasField("seed") else None,
            "negative_prompt": p.negative_prompt,
        }
        return cls(
            task_id=msg.id,
            status=_status(msg.status) or Status.CREATED,
            progress=msg.progress,
            queue_position=msg.queue_position,
            model_id=msg.model_id,
            task_type=msg.task_type,
            prompt=msg.prompt,
            priority=_PRIORITY_NAMES.get(msg.priority, "normal"),
            version=msg.version,
            attempt=msg.attempt,
            retry_count=msg.retry_count,
            max_retries=msg.max_retries,
            error_code=msg.error_code,
            error_message=msg.error_message,
            result=TaskResult.from_proto(msg.result) if msg.HasField("result") and msg.result.uri else None,
            result_reused=msg.result_reused,
            idempotency_key=msg.idempotency_key,
            callback_url=msg.callback_url,
            callback_status=task_pb2.CallbackStatus.Name(msg.callback_status).removeprefix("CALLBACK_STATUS_"),
            worker_id=msg.worker_id,
            metadata=dict(msg.metadata),
            params=params,
            created_at=_time(msg, "created_at"),
            queued_at=_time(msg, "queued_at"),
            started_at=_time(msg, "started_at"),
            finished_at=_time(msg, "finished_at"),
            updated_at=_time(msg, "updated_at"),
            proto=msg,
            created=created,
            estimated_start=_time(msg, "estimated_start"),
            estimated_finish=_time(msg, "estimated_finish"),
            image=InputImage.from_proto(msg.image) if msg.HasField("image") else None,
            replay_of=msg.replay_of or None,
            start_after=_time(msg, "start_after"),
            max_queue_seconds=msg.max_queue_seconds or None,
            queue_expires_at=_time(msg, "queue_expires_at"),
            end_user=msg.end_user,
            answer=TextAnswer.from_proto(msg.text) if msg.HasField("text") else None,
            input_tokens=msg.usage.input_tokens,
            output_tokens=msg.usage.output_tokens,
        )

    def to_dict(self) -> dict[str, object]:
        """A JSON-ready dict (the CLI's --json output)."""
        return {name: _json_value(getattr(self, name)) for name in _TASK_FIELDS}


@dataclass(frozen=True, slots=True)
class TaskEvent:
    """One version of a task from `watch()`: the snapshot first (`snapshot=True`), then each transition."""

    task_id: str
    version: int
    status: Status
    from_status: Status | None
    progress: int
    at: datetime | None
    snapshot: bool = False
    queue_position: int = 0
    attempt: int = 0
    error_code: str = ""
    error_message: str = ""
    reason: str = ""
    result: TaskResult | None = None
    estimated_start: datetime | None = None
    estimated_finish: datetime | None = None

    @property
    def terminal(self) -> bool:
        """Whether this event ends the task."""
        return self.status.terminal

    @classmethod
    def from_snapshot(cls, msg: task_pb2.Task) -> TaskEvent:
        task = Task.from_proto(msg)
        return cls(
            task_id=task.task_id,
            version=task.version,
            status=task.status,
            from_status=None,
            progress=task.progress,
            at=task.updated_at,
            snapshot=True,
            queue_position=task.queue_position,
            attempt=task.attempt,
            error_code=task.error_code,
            error_message=task.error_message,
            result=task.result,
            estimated_start=task.estimated_start,
            estimated_finish=task.estimated_finish,
        )

    @classmethod
    def from_proto(cls, msg: task_pb2.TaskEvent) -> TaskEvent:
        return cls(
            task_id=msg.task_id,
            version=msg.version,
            status=_status(msg.to_status) or Status.CREATED,
            from_status=_status(msg.from_status),
            progress=msg.progress,
            at=_time(msg, "at"),
            attempt=msg.attempt,
            error_code=msg.error_code,
            error_message=msg.error_message,
            reason=msg.reason,
            result=TaskResult.from_proto(msg.result) if msg.HasField("result") and msg.result.uri else None,
            estimated_start=_time(msg, "estimated_start"),
            estimated_finish=_time(msg, "estimated_finish"),
        )

    def to_dict(self) -> dict[str, object]:
        """A JSON-ready dict (one line of `taskgate watch --json`)."""
        return {name: _json_value(getattr(self, name)) for name in _EVENT_FIELDS}


_TASK_FIELDS = [f for f in Task.__dataclass_fields__ if f != "proto"]
_EVENT_FIELDS = list(TaskEvent.__dataclass_fields__)
