"""A fake taskgate for your unit tests: the SDK's own clients over an in-memory, deterministic server.

    from taskgate_client.testing import Fail, FakeTaskgateClient

    def test_my_pipeline(tmp_path) -> None:
        with FakeTaskgateClient() as client:                      # every task succeeds unless told otherwise
            done = client.run("a red fox", output=tmp_path / "fox.mp4")
            assert done.status == "SUCCEEDED"

The fake answers the real clients' calls the way the services do: the same states and versions, the same typed
errors (NotFound, InvalidArgument, AlreadyExists for a reused idempotency key, FailedPrecondition with its reason),
no network and no clock. A task runs when someone follows it (watch, wait, run, a handle's download) and ends as its
outcome says: `Succeed` (default), `Fail`, `TimeOut`, or `StayQueued` (it stays QUEUED until `server.finish()`;
`Hold` is its former name).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import AsyncIterator
from datetime import datetime, timedelta
from functools import cached_property
from typing import Any, TypeVar, cast

import grpc
from google.protobuf import duration_pb2
from google.rpc import error_details_pb2

from taskgate_api import reasons
from taskgate_api.v1 import admin_pb2_grpc, events_pb2, events_pb2_grpc, gateway_pb2, gateway_pb2_grpc, task_pb2
from taskgate_client.aio import AsyncTaskgateClient
from taskgate_client.config import ClientConfig
from taskgate_client.fakecheck import FakeChecks
from taskgate_client.fakerpc import _Call, _info, _invalid, _not_found, _Stub, rpc_error
from taskgate_client.fakestate import (
    _IMAGE_SIGNATURES,
    CHAT,
    CHUNK,
    START,
    SUCCEED,
    TENANT,
    Fail,
    Hold,
    ModelLimits,
    Outcome,
    Script,
    StayQueued,
    Succeed,
    TimeOut,
    _Entry,
    _ts,
)
from taskgate_client.sync import TaskgateClient
from taskgate_client.types import Status

T = TypeVar("T")


class FakeTaskgate(FakeChecks):
    """The in-memory services behind the fake clients: tasks, their history, results, and the test's controls (its
    state and controls are FakeTaskgateState's in fakestate.py, its checks of a submission FakeChecks' in fakecheck.py;
    the RPCs it serves are here)."""

    @cached_property
    def gateway(self) -> _Stub:
        return _Stub(
            {
                "SubmitTask": self._submit,
                "UploadInput": self._upload,
                "GetTask": self._get,
                "ListTasks": self._list,
                "CancelTask": self._cancel,
                "GetTaskResult": lambda request, **_: _Call(self._result(request)),
            }
        )

    @cached_property
    def events(self) -> _Stub:
        return _Stub(
            {
                "WatchTask": lambda request, **_: _Call(self._watch_task(request)),
                "WatchTasks": lambda request, **_: _Call(self._watch_tasks(request)),
            }
        )

    @cached_property
    def admin(self) -> _Stub:
        return _Stub({})

    # -- TaskGateway ---------------------------------------------------------------------------------------------

    async def _upload(
        self, parts: AsyncIterator[gateway_pb2.UploadInputRequest], **_: Any
    ) -> gateway_pb2.UploadInputResponse:
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
            [
                request.task_type or "text-to-video",
                model,
                request.prompt,
                params,
                request.priority or task_pb2.PRIORITY_NORMAL,
                request.callback_url,
                sorted(request.callback_events),
                dict(sorted(request.metadata.items())),
                request.max_retries if request.HasField("max_retries") else 3,
                request.end_user,
            ],
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
                    f"this task is estimated at {self.gpu_seconds_per_task:.1f} GPU-seconds and the tenant's budget "
                    f"has {left:.1f} left this day (UTC)",
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
        # as the real dispatcher, after the answer
        self._move(entry, Status.QUEUED, reason="dispatched", actor="submit")
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
    """A TaskgateClient (blocking) whose calls a FakeTaskgate answers in memory: same methods, same types, same
    errors."""

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
    "StayQueued",
    "Succeed",
    "TimeOut",
    "rpc_error",
]
