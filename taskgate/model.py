"""The task row as Python sees it, and its conversion to the wire message."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from google.protobuf.timestamp_pb2 import Timestamp

from taskgate import chat
from taskgate.states import CallbackStatus, Status
from taskgate_api.v1 import task_pb2


@dataclass(slots=True)
class TaskRow:
    """One row of the task table."""

    id: int
    user_id: str
    idempotency_key: str
    request_hash: str
    task_type: str
    model_id: str
    prompt: str
    request_payload: dict[str, Any]
    priority: int
    queue_name: str
    status: Status
    progress: int
    version: int
    attempt: int
    retry_count: int
    max_retries: int
    created_at: datetime
    updated_at: datetime
    metadata: dict[str, str] = field(default_factory=dict)
    idempotency_derived: bool = False
    publish_count: int = 0
    worker_id: str | None = None
    lease_expires_at: datetime | None = None
    timeout_extended: bool = False
    worker_losses: int = 0  # attempts lost alone (its worker held nothing else): toward max_worker_losses
    company_losses: int = 0  # attempts lost in company (its worker held other tasks too): not toward the cap
    run_alone: bool = False  # it lost a worker: every later attempt runs on a worker that holds nothing else
    alone_for: str | None = None  # QUEUED run_alone: the worker draining to run it
    processed_seconds: float = 0.0
    device_seconds: float = 0.0  # metered, summed over the attempts that ended on their worker
    slot_seconds: float = 0.0
    gpu_reserved: float = 0.0  # GPU-seconds reserved of its tenant's budget at admission (0: no budget)
    tokens_reserved: int = 0  # chat: tokens reserved of its tenant's token budget at admission (0: no budget)
    cancel_mode: str | None = None
    not_before: datetime | None = None
    error_code: str | None = None
    error_msg: str | None = None
    result_uri: str | None = None
    result_content_type: str | None = None
    result_size: int | None = None
    result_sha256: str | None = None
    result_reused: bool = False
    result_expired_at: datetime | None = None
    callback_url: str | None = None
    callback_events: list[str] = field(default_factory=list)
    callback_status: CallbackStatus = CallbackStatus.NONE
    callback_retry: int = 0
    last_actor: str = ""
    last_reason: str | None = None
    queued_at: datetime | None = None
    started_at: datetime | None = None
    finished_at: datetime | None = None
    # W3C headers of the submit's span: every later span continues its trace
    trace_context: dict[str, str] | None = None
    replay_of: int | None = None  # the FAILED or TIMEOUT task an operator replayed as this one
    start_after: datetime | None = None  # asked for at submission: no claim before it
    max_queue_seconds: float | None = None  # asked for at submission: the queue's TTL
    queue_expires_at: datetime | None = None  # when a task still waiting ends TIMEOUT QUEUE_TTL_EXPIRED
    end_user: str = ""  # the tenant's own user it was submitted for ('': the tenant itself)
    result_text: str | None = None  # chat: the answer's beginning, up to result_inline_chars when it finished
    result_chars: int | None = None  # chat: the whole answer's length (the result store holds it all)
    finish_reason: str | None = None  # chat: why generation ended ("stop", "length")
    input_tokens: int = 0  # chat: tokens of its input (the finishing attempt's count)
    output_tokens: int = 0  # chat: tokens its finishing attempt generated
    checkpoint_uri: str | None = None  # the newest step checkpoint a later attempt resumes from (None: step 0)
    checkpoint_step: int = 0  # the steps that checkpoint holds
    # checkpoint objects named or replaced, maybe still stored
    checkpoint_garbage: list[str] = field(default_factory=list)
    wasted_seconds: float = 0.0  # device seconds of steps its attempts had to compute again (metered apart)
    preempted_at: datetime | None = None  # when the scheduler last preempted it for a task of higher priority

    @classmethod
    def from_record(cls, rec: Any) -> TaskRow:
        """Builds from an asyncpg Record (extra columns such as old_status are ignored)."""
        present = set(rec.keys())
        data = {f.name: rec[f.name] for f in _FIELDS if f.name in present}
        data["status"] = Status(data["status"])
        if "callback_status" in data:
            data["callback_status"] = CallbackStatus(data["callback_status"])
        for key in ("request_payload", "metadata", "trace_context"):
            if isinstance(data.get(key), str):
                data[key] = json.loads(data[key])
        data["callback_events"] = list(data.get("callback_events") or [])
        return cls(**data)

    def _chat_proto(self, queue_position: int) -> task_pb2.Task:
        """A chat task: its generation parameters (not its messages: an input may be megabytes) and its answer."""
        p = self.request_payload
        msg = self._common_proto(queue_position)
        msg.chat.CopyFrom(task_pb2.ChatParams(
            max_output_tokens=int(p.get("max_output_tokens", 0)), temperature=float(p.get("temperature", 0.0)),
            top_p=float(p.get("top_p", 1.0)), stop=[str(s) for s in p.get("stop", [])],
        ))
        if p.get("seed") is not None:
            msg.chat.seed = int(p["seed"])
        msg.usage.input_tokens = self.input_tokens or int(p.get(chat.INPUT_TOKENS, 0))
        msg.usage.output_tokens = self.output_tokens
        if self.result_text is not None:
            chars = self.result_chars if self.result_chars is not None else len(self.result_text)
            msg.text.CopyFrom(task_pb2.TextResult(
                text=self.result_text, truncated=len(self.result_text) < chars, finish_reason=self.finish_reason or "",
                chars=chars,
            ))
        return msg

    def to_proto(self, queue_position: int = 0) -> task_pb2.Task:
        if self.task_type == chat.TASK_TYPE:
            return self._chat_proto(queue_position)
        p = self.request_payload
        msg = self._common_proto(queue_position)
        msg.params.CopyFrom(task_pb2.VideoParams(
            num_frames=int(p.get("num_frames", 0)),
            width=int(p.get("width", 0)),
            height=int(p.get("height", 0)),
            num_inference_steps=int(p.get("num_inference_steps", 0)),
            guidance_scale=float(p.get("guidance_scale", 0.0)),
            fps=int(p.get("fps", 0)),
            negative_prompt=str(p.get("negative_prompt", "")),
        ))
        if p.get("seed") is not None:
            msg.params.seed = int(p["seed"])
        image = p.get("image")
        if isinstance(image, dict):
            msg.image.CopyFrom(task_pb2.InputImage(
                sha256=str(image["sha256"]), width=int(image["width"]), height=int(image["height"]),
                size_bytes=int(image.get("size_bytes", 0)), content_type="image/png",
            ))
        return msg

    def _common_proto(self, queue_position: int) -> task_pb2.Task:
        """The fields every task type has."""
        msg = task_pb2.Task(
            id=str(self.id),
            user_id=self.user_id,
            task_type=self.task_type,
            model_id=self.model_id,
            prompt=self.prompt,
            priority=self.priority,  # type: ignore[arg-type]
            status=self.status.to_proto(),
            progress=self.progress,
            attempt=self.attempt,
            retry_count=self.retry_count,
            max_retries=self.max_retries,
            error_code=self.error_code or "",
            error_message=self.error_msg or "",
            callback_url=self.callback_url or "",
            callback_status=self.callback_status.to_proto(),
            version=self.version,
            worker_id=self.worker_id or "",
            queue_position=queue_position,
            idempotency_key=self.idempotency_key,
            metadata=self.metadata,
            callback_events=self.callback_events,
            result_reused=self.result_reused,
            replay_of=str(self.replay_of) if self.replay_of is not None else "",
            usage=task_pb2.TaskUsage(gpu_seconds=self.device_seconds, slot_seconds=self.slot_seconds),
            end_user=self.end_user,
        )
        if self.result_uri:
            msg.result.CopyFrom(
                task_pb2.TaskResult(
                    uri=self.result_uri,
                    content_type=self.result_content_type or "",
                    size_bytes=self.result_size or 0,
                    sha256=self.result_sha256 or "",
                )
            )
            if self.result_expired_at is not None:
                msg.result.deleted_at.CopyFrom(timestamp(self.result_expired_at))
        if self.max_queue_seconds is not None:
            msg.max_queue_seconds = self.max_queue_seconds
        for name in (
            "created_at",
            "queued_at",
            "started_at",
            "finished_at",
            "updated_at",
            "start_after",
            "queue_expires_at",
        ):
            value = getattr(self, name)
            if value is not None:
                set_timestamp(getattr(msg, name), value)
        return msg


_FIELDS = dataclasses.fields(TaskRow)


_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


def set_timestamp(ts: Timestamp, value: datetime) -> None:
    """Timestamp.FromDatetime's result (a naive value is UTC), without its Python detour through a time tuple (a
    third of the time: a GetTask sets five)."""
    since = (value if value.tzinfo is not None else value.replace(tzinfo=UTC)) - _EPOCH
    ts.seconds = since.days * 86_400 + since.seconds
    ts.nanos = since.microseconds * 1000


def timestamp(value: datetime) -> Timestamp:
    ts = Timestamp()
    set_timestamp(ts, value)
    return ts
