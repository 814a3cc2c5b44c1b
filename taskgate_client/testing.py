"""A fake taskgate for your unit tests: the SDK's own clients over an in-memory, deterministic server.

    from taskgate_client.testing import Fail, FakeTaskgateClient

    def test_my_pipeline(tmp_path) -> None:
        with FakeTaskgateClient() as client:                      # every task succeeds unless told otherwise
            done = client.run("a red fox", output=tmp_path / "fox.mp4")
            assert done.status == "SUCCEEDED"

The fake answers the real clients' calls the way the services do: the same states and versions, the same typed
errors (NotFound, InvalidArgument, AlreadyExists for a reused idempotency key, FailedPrecondition with its reason),
no network and no clock. A task runs when someone follows it (watch, wait, run, a handle's download) and ends as its
outcome says: `Succeed` (default), `Fail`, `TimeOut`, or `Hold` (it stays QUEUED until `server.finish()`).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import re
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any, NoReturn, TypeVar, cast

import grpc
from google.protobuf import any_pb2, duration_pb2
from google.protobuf.message import Message
from google.protobuf.timestamp_pb2 import Timestamp
from google.rpc import error_details_pb2, status_pb2

from taskgate_api import reasons
from taskgate_api._compat import UTC
from taskgate_api.v1 import admin_pb2_grpc, events_pb2, events_pb2_grpc, gateway_pb2, gateway_pb2_grpc, task_pb2
from taskgate_client.aio import AsyncTaskgateClient
from taskgate_client.config import ClientConfig
from taskgate_client.sync import TaskgateClient
from taskgate_client.types import Status, Task

T = TypeVar("T")

TENANT = "fake-tenant"

START = datetime(2025, 1, 1, tzinfo=UTC)  # the fake clock's first reading; each change is one second later
CHUNK = 64 * 1024
CALLBACK_EVENTS = frozenset({"CANCELED", "OUTPUT", "PROGRESS"})
CHAT = "chat"


@dataclass(frozen=True, slots=True)
class Succeed:
    """The task runs, reports each `progress` percentage, and succeeds with `data` (None: bytes made from the prompt)."""

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
class Hold:
    """The task stays QUEUED until the test calls `server.finish()` or cancels it."""


Outcome = Succeed | Fail | TimeOut | Hold
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


def rpc_error(code: grpc.StatusCode, message: str, *details: Message) -> grpc.aio.AioRpcError:
    """The error a real call fails with: `code`, `message` and google.rpc details in the trailing metadata."""
    packed = []
    for detail in details:
        anyp = any_pb2.Any()
        anyp.Pack(detail)
        packed.append(anyp)
    status = status_pb2.Status(code=code.value[0], message=message, details=packed)
    trailing = grpc.aio.Metadata(("grpc-status-details-bin", status.SerializeToString()))
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), trailing, details=message)


def _info(reason: str, **metadata: str) -> error_details_pb2.ErrorInfo:
    return error_details_pb2.ErrorInfo(reason=reason, domain=reasons.DOMAIN, metadata=metadata)


def _invalid(violations: list[tuple[str, str]]) -> grpc.aio.AioRpcError:
    bad = error_details_pb2.BadRequest(
        field_violations=[error_details_pb2.BadRequest.FieldViolation(field=f, description=d) for f, d in violations]
    )
    summary = "; ".join(f"{f}: {d}" for f, d in violations)
    return rpc_error(grpc.StatusCode.INVALID_ARGUMENT, f"invalid request: {summary}", bad)


def _not_found(what: str = "task") -> grpc.aio.AioRpcError:
    return rpc_error(grpc.StatusCode.NOT_FOUND, f"{what} not found", _info(reasons.NOT_FOUND))


class _Call:
    """A server-streaming call: iterate it, cancel it."""

    def __init__(self, source: AsyncIterator[Any]) -> None:
        self._source = source

    def __aiter__(self) -> AsyncIterator[Any]:
        return self._source

    def cancel(self) -> bool:
        return True


class _Unimplemented:
    """What an RPC the fake does not serve returns, awaited or iterated: UNIMPLEMENTED."""

    def __init__(self, name: str) -> None:
        self._error = rpc_error(grpc.StatusCode.UNIMPLEMENTED, f"the fake taskgate does not serve {name}")

    async def _fail(self) -> NoReturn:
        raise self._error

    def __await__(self) -> Any:
        return self._fail().__await__()

    def __aiter__(self) -> _Unimplemented:
        return self

    async def initial_metadata(self) -> tuple[()]:  # a stream's headers: none, the call is over
        return ()

    def done(self) -> bool:
        return True

    async def __anext__(self) -> NoReturn:
        raise self._error

    def cancel(self) -> bool:
        return True


class _Stub:
    """Serves the named RPCs from `methods`; any other is UNIMPLEMENTED, as on a server without it."""

    def __init__(self, methods: dict[str, Callable[..., Any]]) -> None:
        self._methods = methods

    def __getattr__(self, name: str) -> Callable[..., Any]:
        method = self._methods.get(name)
        if method is not None:
            return method
        return lambda *args, **kwargs: _Unimplemented(name)


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


class FakeTaskgate:
    """The in-memory services behind the fake clients: tasks, their history, results, and the test's controls."""

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
        while it is unfinished, is settled to the tokens it used when it succeeds and releases them otherwise; one that
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
        self.gateway = _Stub(
            {
                "SubmitTask": self._submit,
                "UploadInput": self._upload,
                "GetTask": self._get,
                "ListTasks": self._list,
                "CancelTask": self._cancel,
                "GetTaskResult": lambda request, **_: _Call(self._result(request)),
            }
        )
        self.events = _Stub(
            {
                "WatchTask": lambda request, **_: _Call(self._watch_task(request)),
                "WatchTasks": lambda request, **_: _Call(self._watch_tasks(request)),
            }
        )
        self.admin = _Stub({})

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
        self, rpc: str, code: grpc.StatusCode, message: str = "injected", *, reason: str = "", retry_delay: float | None = None
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
        if isinstance(outcome, Hold):
            return
        self._move(entry, Status.PROCESSING, reason="claimed", actor="worker", progress=0)
        for pct in outcome.progress if not isinstance(outcome, TimeOut) else ():
            self._move(entry, Status.PROCESSING, reason="progress", actor="worker", progress=pct)
        if isinstance(outcome, Succeed):
            task = entry.task
            chat = task.task_type == CHAT
            entry.data = outcome.data if outcome.data is not None else (self._answer(task) if chat else self._video(task))
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
            self._move(entry, Status.TIMEOUT, reason="processing timeout", actor="scheduler", error=("PROCESSING_TIMEOUT", outcome.message))

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
        digest = hashlib.sha256(f"{task.model_id}\n{task.prompt}\n{task.params.seed}\n{task.image.sha256}".encode()).digest()
        return b"FAKE-MP4\n" + digest * 8

    def _autorun(self, entry: _Entry) -> None:
        if entry.task.status in (task_pb2.TASK_STATUS_CREATED, task_pb2.TASK_STATUS_QUEUED):
            script = self.outcome
            outcome = script(Task.from_proto(self._copy(entry.task))) if callable(script) else script
            self._run(entry, outcome or SUCCEED)

    # -- TaskGateway ---------------------------------------------------------------------------------------------

    def _check(self, req: gateway_pb2.SubmitTaskRequest) -> tuple[str, dict[str, Any]]:
        """INVALID_ARGUMENT naming every bad field (the services' rules for a default model), or the model and params."""
        bad: list[tuple[str, str]] = []
        if (req.task_type or "text-to-video") == CHAT:
            return self._check_chat(req, bad)
        if req.HasField("chat"):
            bad.append(("chat", "only a chat task takes chat parameters"))
        if not req.prompt.strip():
            bad.append(("prompt", "must not be empty"))
        model = req.model_id or self.default_model
        if model not in self.models:
            bad.append(("model_id", f"unknown model; known: {', '.join(sorted(self.models))}"))
        served = "image-to-video" if model in self.image_models else CHAT if model in self.chat_models else "text-to-video"
        task_type = req.task_type or "text-to-video"
        if task_type != served:
            bad.append(("task_type", f"model {model} supports {served}"))
        image = self._image(req, task_type, bad)
        lim, p = self.limits, req.params
        frames = p.num_frames or lim.default_frames
        if frames < 1 or frames > lim.max_frames or (frames - 1) % lim.frame_step:
            bad.append(("params.num_frames", f"must be 1..{lim.max_frames} with num_frames - 1 a multiple of {lim.frame_step}"))
        width, height = p.width or lim.default_width, p.height or lim.default_height
        for name, size in (("width", width), ("height", height)):
            if size < 1 or size > lim.max_size or size % lim.size_multiple:
                bad.append((f"params.{name}", f"must be a multiple of {lim.size_multiple} up to {lim.max_size}"))
        steps = p.num_inference_steps or lim.default_steps
        if steps < 1 or steps > lim.max_steps:
            bad.append(("params.num_inference_steps", f"must be 1..{lim.max_steps}"))
        guidance = p.guidance_scale or lim.default_guidance
        if guidance < 0 or guidance > lim.max_guidance:
            bad.append(("params.guidance_scale", f"must be 0..{lim.max_guidance}"))
        fps = p.fps or lim.default_fps
        if fps < 1 or fps > lim.max_fps:
            bad.append(("params.fps", f"must be 1..{lim.max_fps}"))
        if p.HasField("seed") and p.seed < 0:
            bad.append(("params.seed", "must not be negative"))
        if req.HasField("max_retries") and not 0 <= req.max_retries <= 10:
            bad.append(("max_retries", "must be 0..10"))
        if req.HasField("max_queue_seconds") and not 0 < req.max_queue_seconds <= 7 * 86400:
            bad.append(("max_queue_seconds", "must be above 0 and at most 604800"))
        events = set(req.callback_events)
        if events - CALLBACK_EVENTS:
            bad.append(("callback_events", f"each must be one of {', '.join(sorted(CALLBACK_EVENTS))}"))
        elif events and not req.callback_url:
            bad.append(("callback_events", "need a callback_url"))
        if req.callback_url and not req.callback_url.startswith(("http://", "https://")):
            bad.append(("callback_url", "must be an http or https URL"))
        if bad:
            raise _invalid(bad)
        params = {
            "num_frames": frames, "width": width, "height": height, "num_inference_steps": steps,
            "guidance_scale": round(guidance, 4), "fps": fps, "seed": p.seed if p.HasField("seed") else None,
            "negative_prompt": p.negative_prompt,
        }
        if image is not None:
            params["image"] = image
        return model, params

    def _check_chat(self, req: gateway_pb2.SubmitTaskRequest, bad: list[tuple[str, str]]) -> tuple[str, dict[str, Any]]:
        """A chat request by the services' rules (no token count: the fake has no tokenizer), or INVALID_ARGUMENT."""
        model = req.model_id or self.default_model
        if model not in self.chat_models:
            bad.append(("model_id" if model not in self.models else "task_type", f"model {model} serves no chat tasks"))
        for given, _ in req.params.ListFields():
            bad.append((f"params.{given.name}", "a chat task takes no video parameters; use chat"))
        c = req.chat
        if c.messages and req.prompt:
            bad.append(("prompt", "give the prompt or chat.messages, not both"))
        messages = [{"role": m.role, "content": self._attached(m, i, bad)} for i, m in enumerate(c.messages)] or [
            {"role": "user", "content": req.prompt}]
        for i, m in enumerate(messages):
            if m["role"] not in ("system", "user", "assistant"):
                bad.append((f"chat.messages[{i}].role", "must be one of system, user, assistant"))
        if messages[-1]["role"] != "user" or not messages[-1]["content"].strip():
            bad.append(("chat.messages" if c.messages else "prompt", "must end with a user message that is not empty"))
        max_tokens = c.max_output_tokens if c.HasField("max_output_tokens") else 256
        if max_tokens < 1:
            bad.append(("chat.max_output_tokens", "must be at least 1"))
        if c.HasField("temperature") and not 0 <= c.temperature <= 2:
            bad.append(("chat.temperature", "must be 0..2"))
        if c.HasField("top_p") and not 0 < c.top_p <= 1:
            bad.append(("chat.top_p", "must be above 0 and at most 1"))
        if c.HasField("seed") and c.seed < 0:
            bad.append(("chat.seed", "must not be negative"))
        if bad:
            raise _invalid(bad)
        return model, {
            "messages": messages, "max_output_tokens": max_tokens, "temperature": c.temperature if c.HasField("temperature") else 1.0,
            "top_p": c.top_p if c.HasField("top_p") else 1.0, "stop": list(c.stop), "seed": c.seed if c.HasField("seed") else None,
        }

    def _image(self, req: gateway_pb2.SubmitTaskRequest, task_type: str, bad: list[tuple[str, str]]) -> str | None:
        """The sha256 naming the request's image, or None (with the reason in `bad` when one was due or wrong)."""
        if task_type != "image-to-video":
            if req.HasField("image"):
                bad.append(("image", f"task_type {task_type} takes no image; use image-to-video"))
            return None
        if not req.HasField("image"):
            bad.append(("image", f"task_type {task_type} needs an input image"))
            return None
        source = req.image.WhichOneof("source")
        if source == "data":
            if not req.image.data.startswith(_IMAGE_SIGNATURES) and req.image.data[8:12] != b"WEBP":
                bad.append(("image.data", "is not an image in an allowed format (PNG, JPEG, WEBP)"))
                return None
            return hashlib.sha256(req.image.data).hexdigest()
        if source == "url":
            if not req.image.url.startswith("https://"):
                bad.append(("image.url", "may not be fetched: only https URLs are"))
                return None
            return hashlib.sha256(req.image.url.encode()).hexdigest()
        if source == "upload_sha256":
            if req.image.upload_sha256 not in self._uploads:
                bad.append(("image.upload_sha256", "names no input image of this tenant (never uploaded, or expired)"))
                return None
            return req.image.upload_sha256
        bad.append(("image", "needs one of data, url or upload_sha256"))
        return None

    def _attached(self, message: task_pb2.ChatMessage, i: int, bad: list[tuple[str, str]]) -> str:
        """A chat message's content with the text upload it names appended (after a blank line), as the gateway does."""
        if not message.content_sha256:
            return message.content
        text = self._texts.get(message.content_sha256)
        if text is None:
            bad.append((f"chat.messages[{i}].content_sha256", "names no text attachment of this tenant (never uploaded, or expired)"))
            return message.content
        return f"{message.content}\n\n{text}" if message.content else text

    async def _upload(self, parts: AsyncIterator[gateway_pb2.UploadInputRequest], **_: Any) -> gateway_pb2.UploadInputResponse:
        self._injected("UploadInput")
        received = [part async for part in parts]
        data = b"".join(part.data for part in received)
        if received and received[0].content_type.split(";", 1)[0].strip().lower() == "text/plain":
            try:
                text = data.decode("utf-8")
            except UnicodeDecodeError:
                raise _invalid([("data", "not UTF-8 text")]) from None
            if not text or "\x00" in text:
                raise _invalid([("data", "is empty" if not text else "contains U+0000, which cannot be stored")])
            sha256 = hashlib.sha256(data).hexdigest()
            self._texts[sha256] = text
            return gateway_pb2.UploadInputResponse(
                text=task_pb2.InputText(sha256=sha256, size_bytes=len(data), chars=len(text), content_type="text/plain")
            )
        if not data.startswith(_IMAGE_SIGNATURES) and data[8:12] != b"WEBP":
            raise _invalid([("data", "is not an image in an allowed format (PNG, JPEG, WEBP)")])
        sha256 = hashlib.sha256(data).hexdigest()
        self._uploads.add(sha256)
        return gateway_pb2.UploadInputResponse(
            image=task_pb2.InputImage(sha256=sha256, size_bytes=len(data), content_type="image/png")
        )

    async def _submit(self, request: gateway_pb2.SubmitTaskRequest, **_: Any) -> gateway_pb2.SubmitTaskResponse:
        self._injected("SubmitTask")
        model, params = self._check(request)
        fingerprint = json.dumps(
            [request.task_type or "text-to-video", model, request.prompt, params, request.priority or task_pb2.PRIORITY_NORMAL,
             request.callback_url, sorted(request.callback_events), dict(sorted(request.metadata.items())),
             request.max_retries if request.HasField("max_retries") else 3, request.end_user],
            sort_keys=True,
        )
        key = request.idempotency_key or hashlib.sha256(fingerprint.encode()).hexdigest()
        existing = self._keys.get((request.end_user, key))
        if existing is not None:
            entry = self._tasks[existing]
            if entry.fingerprint != fingerprint:
                raise rpc_error(
                    grpc.StatusCode.ALREADY_EXISTS,
                    "this idempotency key belongs to a different request",
                    _info(reasons.IDEMPOTENCY_KEY_REUSED, task_id=entry.task.id),
                )
            return gateway_pb2.SubmitTaskResponse(task=self._copy(entry.task, position=True), created=False)
        pending = sum(1 for e in self._tasks.values() if not Status.from_proto(e.task.status).terminal)
        if self.max_pending is not None and pending >= self.max_pending:
            raise rpc_error(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"at most {self.max_pending} unfinished tasks per tenant; wait for one to finish",
                _info(reasons.TOO_MANY_PENDING_TASKS, limit=str(self.max_pending), scope="tenant"),
            )
        if self.gpu_seconds_per_day is not None:
            spent = self.gpu_seconds_per_task * sum(
                1 for e in self._tasks.values()
                if not (e.task.status == task_pb2.TASK_STATUS_CANCELED and not e.task.HasField("started_at"))
            )
            left = max(self.gpu_seconds_per_day - spent, 0.0)
            if self.gpu_seconds_per_task > left:
                delay = self._to_midnight()
                raise rpc_error(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"this task is estimated at {self.gpu_seconds_per_task:.1f} GPU-seconds and the tenant's budget has "
                    f"{left:.1f} left this day (UTC)",
                    _info(reasons.QUOTA_EXCEEDED, budget="gpu_seconds", window="day", gpu_seconds_left=f"{left:.3f}",
                          gpu_seconds_estimate=f"{self.gpu_seconds_per_task:.3f}"),
                    error_details_pb2.RetryInfo(retry_delay=delay),
                )
        if self.tokens_per_day is not None and request.task_type == CHAT:
            reserve = sum(len(m["content"].split()) for m in params["messages"]) + params["max_output_tokens"]
            left = max(self.tokens_per_day - sum(self._tokens_charged(e.task) for e in self._tasks.values()), 0)
            if reserve > left:
                raise rpc_error(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"this task reserves {reserve} tokens (its max_output_tokens and its input) and the tenant's token "
                    f"budget has {left} left this day (UTC)",
                    _info(reasons.QUOTA_EXCEEDED, budget="tokens", window="day", tokens_left=str(left),
                          tokens_estimate=str(reserve)),
                    error_details_pb2.RetryInfo(retry_delay=self._to_midnight()),
                )
        task_id = len(self._tasks) + 1
        seed = params["seed"]
        if seed is None:
            seed = int.from_bytes(hashlib.sha256(f"{task_id}\n{request.prompt}".encode()).digest()[:4], "big")
        chat = request.task_type == CHAT
        last_user = next((m["content"] for m in reversed(params.get("messages", [])) if m["role"] == "user"), "")
        task = task_pb2.Task(
            id=str(task_id),
            user_id=TENANT,
            task_type=request.task_type or "text-to-video",
            model_id=model,
            prompt=last_user[:2000] if chat else request.prompt,
            params=None if chat else task_pb2.VideoParams(
                num_frames=params["num_frames"], width=params["width"], height=params["height"],
                num_inference_steps=params["num_inference_steps"], guidance_scale=params["guidance_scale"],
                fps=params["fps"], seed=seed, negative_prompt=params["negative_prompt"],
            ),
            chat=task_pb2.ChatParams(
                max_output_tokens=params["max_output_tokens"], temperature=params["temperature"], top_p=params["top_p"],
                stop=params["stop"], seed=seed,
            ) if chat else None,
            priority=request.priority or task_pb2.PRIORITY_NORMAL,
            max_retries=request.max_retries if request.HasField("max_retries") else 3,
            idempotency_key=key,
            callback_url=request.callback_url,
            callback_events=sorted(request.callback_events),
            metadata=dict(request.metadata),
            end_user=request.end_user,
        )
        # recorded as asked; the fake's clock runs tasks when the test says, so it neither delays nor expires them
        if request.HasField("start_after"):
            task.start_after.CopyFrom(request.start_after)
        if request.HasField("max_queue_seconds"):
            task.max_queue_seconds = request.max_queue_seconds
        if chat:
            task.usage.input_tokens = sum(len(m["content"].split()) for m in params["messages"])
        if "image" in params:
            task.image.CopyFrom(task_pb2.InputImage(sha256=params["image"], content_type="image/png"))
        task.created_at.CopyFrom(_ts(START + timedelta(seconds=self._ticks + 1)))
        entry = _Entry(task, fingerprint)
        self._tasks[task_id] = entry
        self._keys[(request.end_user, key)] = task_id
        self._move(entry, Status.CREATED, reason="submitted", actor="submit")
        answer = gateway_pb2.SubmitTaskResponse(task=self._copy(task, position=True), created=True)
        self._move(entry, Status.QUEUED, reason="dispatched", actor="submit")  # as the real dispatcher, after the answer
        return answer

    def _to_midnight(self) -> duration_pb2.Duration:
        """From the fake clock's now to its next midnight, when a day's budget resets."""
        now = START + timedelta(seconds=self._ticks)
        midnight = datetime.combine(now.date() + timedelta(days=1), datetime.min.time(), tzinfo=now.tzinfo)
        delay = duration_pb2.Duration()
        delay.FromTimedelta(midnight - now)
        return delay

    @staticmethod
    def _tokens_charged(task: task_pb2.Task) -> int:
        """A chat task's charge to the token budget: its reservation while unfinished, the tokens it used once it
        succeeded, nothing once it failed, timed out or was cancelled."""
        if task.task_type != CHAT:
            return 0
        status = Status.from_proto(task.status)
        if not status.terminal:
            return task.usage.input_tokens + task.chat.max_output_tokens
        return task.usage.input_tokens + task.usage.output_tokens if status is Status.SUCCEEDED else 0

    async def _get(self, request: gateway_pb2.GetTaskRequest, **_: Any) -> gateway_pb2.GetTaskResponse:
        self._injected("GetTask")
        entry = self._entry(request.task_id)
        interval = duration_pb2.Duration()
        interval.FromMilliseconds(10)  # the fake has no clock to wait for
        return gateway_pb2.GetTaskResponse(task=self._copy(entry.task, position=True), suggested_poll_interval=interval)

    async def _list(self, request: gateway_pb2.ListTasksRequest, **_: Any) -> gateway_pb2.ListTasksResponse:
        self._injected("ListTasks")
        size = min(max(request.page_size or 50, 1), 500)
        wanted = set(request.statuses)
        token = f"|{sorted(wanted)}"
        start = None
        if request.page_token:
            last, _sep, rest = request.page_token.partition("|")
            if f"|{rest}" != token or not last.isdigit():
                raise _invalid([("page_token", "not a page token of this listing")])
            start = int(last)
        ids = [i for i in sorted(self._tasks, reverse=True) if start is None or i < start]
        tasks = [self._tasks[i].task for i in ids if not wanted or self._tasks[i].task.status in wanted]
        page = tasks[:size]
        next_token = f"{page[-1].id}{token}" if len(tasks) > size else ""
        return gateway_pb2.ListTasksResponse(tasks=[self._copy(t) for t in page], next_page_token=next_token)

    async def _cancel(self, request: gateway_pb2.CancelTaskRequest, **_: Any) -> gateway_pb2.CancelTaskResponse:
        self._injected("CancelTask")
        entry = self._entry(request.task_id)
        status = Status.from_proto(entry.task.status)
        if status.terminal and status is not Status.CANCELED:
            raise rpc_error(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"the task already finished as {status.value}",
                _info(reasons.TASK_FINISHED, status=status.value),
            )
        if status is not Status.CANCELED:
            mode = "hard" if request.hard else "soft"
            self._move(entry, Status.CANCELED, reason=f"{mode} cancel by client", actor="submit")
        return gateway_pb2.CancelTaskResponse(task=self._copy(entry.task))

    async def _result(self, request: gateway_pb2.GetTaskResultRequest) -> AsyncIterator[gateway_pb2.ResultChunk]:
        self._injected("GetTaskResult")
        entry = self._entry(request.task_id)
        if request.preview_uri:  # the fake makes no preview images: none of them is found
            raise _not_found("preview")
        status = Status.from_proto(entry.task.status)
        if status is not Status.SUCCEEDED:
            raise rpc_error(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"the task is {status.value}; only SUCCEEDED tasks have a result",
                _info(reasons.TASK_NOT_SUCCEEDED, status=status.value),
            )
        for offset in range(0, max(len(entry.data), 1), CHUNK):
            chunk = gateway_pb2.ResultChunk(data=entry.data[offset : offset + CHUNK], offset=offset)
            if offset == 0:
                chunk.info.CopyFrom(entry.task.result)
            yield chunk

    # -- TaskEvents ----------------------------------------------------------------------------------------------

    async def _watch_task(self, request: events_pb2.WatchTaskRequest) -> AsyncIterator[events_pb2.WatchTaskResponse]:
        self._injected("WatchTask")
        entry = self._entry(request.task_id)
        if request.after_version < 0:
            raise _invalid([("after_version", "must not be negative")])
        if request.after_version > entry.task.version:
            raise _invalid([("after_version", f"is ahead of the task's version {entry.task.version}")])
        if request.after_output_sequence < 0:
            raise _invalid([("after_output_sequence", "must not be negative")])
        last = request.after_version
        sent = request.after_output_sequence

        def output(before: int) -> list[events_pb2.WatchTaskResponse]:
            """The chunks not sent yet that were stored before version `before` (the chunks come before it)."""
            nonlocal sent
            out = []
            for after, chunk in entry.output if request.include_output else ():
                if chunk.sequence > sent and after < before:
                    out.append(events_pb2.WatchTaskResponse(output=chunk))
                    sent = chunk.sequence
            return out

        if last == 0:
            yield events_pb2.WatchTaskResponse(snapshot=self._copy(entry.task, position=True))
            last = entry.task.version
        self._autorun(entry)  # after the snapshot, so the watcher sees the run as it would live
        while True:
            for event in entry.history:
                if event.version > last:
                    for out in output(event.version):
                        yield out
                    yield events_pb2.WatchTaskResponse(event=event)
                    last = event.version
                    if Status.from_proto(event.to_status).terminal:
                        return
            if Status.from_proto(entry.task.status).terminal:
                for out in output(2**62):
                    yield out
                return
            await self._changes(len(self._log))

    async def _watch_tasks(self, request: events_pb2.WatchTasksRequest) -> AsyncIterator[events_pb2.WatchTasksResponse]:
        self._injected("WatchTasks")
        wanted = set(request.statuses)
        if any(s == task_pb2.TASK_STATUS_UNSPECIFIED or s not in task_pb2.TaskStatus.values() for s in wanted):
            raise _invalid([("statuses", "each must be a known status")])
        if request.cursor and not request.cursor.isdigit():
            raise _invalid([("cursor", "not a cursor from this API")])
        seen = int(request.cursor) if request.cursor else len(self._log)
        caught_up = False
        while True:
            while seen < len(self._log):
                event = self._log[seen]
                seen += 1
                if not wanted or event.to_status in wanted:
                    yield events_pb2.WatchTasksResponse(event=event, cursor=str(seen))
            if not caught_up:
                caught_up = True
                yield events_pb2.WatchTasksResponse(keepalive=events_pb2.KeepAlive(), cursor=str(seen))
            await self._changes(seen)



class FakeAsyncTaskgateClient(AsyncTaskgateClient):
    """An AsyncTaskgateClient whose calls a FakeTaskgate answers in memory: same methods, same types, same errors."""

    def __init__(self, server: FakeTaskgate | None = None, *, outcome: Script = SUCCEED) -> None:
        super().__init__(ClientConfig(address="fake-taskgate:50051", api_key="tg_fake", retry_max_delay=0.05))
        self.server = server or FakeTaskgate(outcome=outcome)
        """The fake services: `finish()`, `fail_next()`, `tasks()`."""

    def _channel(self, address: str) -> grpc.aio.Channel:
        raise AssertionError("the fake client opens no channel")  # every stub below is in memory

    @property
    def _gateway(self) -> gateway_pb2_grpc.TaskGatewayAsyncStub:
        return cast("gateway_pb2_grpc.TaskGatewayAsyncStub", self.server.gateway)

    @property
    def _events(self) -> events_pb2_grpc.TaskEventsAsyncStub:
        return cast("events_pb2_grpc.TaskEventsAsyncStub", self.server.events)

    @property
    def admin_stub(self) -> admin_pb2_grpc.TaskAdminAsyncStub:
        """The fake serves no admin calls: each fails with UNIMPLEMENTED."""
        return cast("admin_pb2_grpc.TaskAdminAsyncStub", self.server.admin)


class FakeTaskgateClient(TaskgateClient):
    """A TaskgateClient (blocking) whose calls a FakeTaskgate answers in memory: same methods, same types, same errors."""

    def __init__(self, server: FakeTaskgate | None = None, *, outcome: Script = SUCCEED) -> None:
        self.server = server or FakeTaskgate(outcome=outcome)
        """The fake services: `finish()`, `fail_next()`, `tasks()`."""
        super().__init__(ClientConfig(address="fake-taskgate:50051", api_key="tg_fake", retry_max_delay=0.05))

    def _async_client(self, config: ClientConfig) -> AsyncTaskgateClient:
        return FakeAsyncTaskgateClient(self.server)


__all__ = [
    "Fail",
    "FakeAsyncTaskgateClient",
    "FakeTaskgate",
    "FakeTaskgateClient",
    "Hold",
    "ModelLimits",
    "Outcome",
    "Succeed",
    "TimeOut",
    "rpc_error",
]
