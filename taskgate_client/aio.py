"""The asyncio client: submit, follow, cancel and download tasks; admin calls for operators."""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import hashlib
import os
import urllib.error
import urllib.request
import uuid
from collections import OrderedDict
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Iterable, Mapping
from datetime import datetime
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any, TypeVar, cast

import grpc
from google.protobuf import duration_pb2
from tenacity import AsyncRetrying, RetryCallState, retry_if_exception, stop_after_attempt, wait_exponential_jitter

from taskgate_api import _compat as compat
from taskgate_api import reasons
from taskgate_api.v1 import admin_pb2, admin_pb2_grpc, events_pb2, events_pb2_grpc, gateway_pb2, gateway_pb2_grpc, task_pb2
from taskgate_client import tracecontext
from taskgate_client.config import ClientConfig, ConnectOptions, channel_target, make_config
from taskgate_client.errors import (
    IntegrityError,
    NotFound,
    TaskFailed,
    TaskgateError,
    Unavailable,
    WaitTimeout,
    from_rpc_error,
    from_status,
    retryable,
)
from taskgate_client.handles import AsyncTaskHandle
from taskgate_client.pipeline import StreamUnavailable, SubmitPipe
from taskgate_client.streaming import Output, Preview, TextAssembler, TextDelta
from taskgate_client.types import (
    CHAT,
    ChatInput,
    ChatOptions,
    ImageSource,
    InputImage,
    InputText,
    Status,
    SubmitItem,
    SubmitOptions,
    Task,
    TaskEvent,
    TaskResult,
    priority_value,
)

if TYPE_CHECKING:  # 3.11 typing names, in annotations only: the client also runs on 3.10
    from typing import Self, Unpack

T = TypeVar("T")

# A stream that ends with one of these is resumed; the others are the caller's problem.
RESUMABLE = frozenset(
    {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.ABORTED, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED}
)
# When the event stream itself cannot be used, wait() polls instead.
POLL_INSTEAD = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNIMPLEMENTED, grpc.StatusCode.DEADLINE_EXCEEDED})
DEFAULT_POLL_SECONDS = 1.0
DOWNLOAD_CHUNK = 256 * 1024
# watch_all() skips an event it already yielded (a resume may replay some); this many tasks are remembered.
TRACKED_TASKS = 10_000
MAX_SUBMIT_BATCH = 1000  # tasks per SubmitTasks call, the gateway's limit
INLINE_IMAGE_BYTES = 2 * 1024 * 1024  # an image file up to this size travels in the request; a larger one is uploaded first
UPLOAD_PART = 1024 * 1024

StatusFilter = str | Status | Iterable[str | Status] | None


def _statuses(status: StatusFilter) -> list[task_pb2.TaskStatus.ValueType]:
    if status is None:
        return []
    items = [status] if isinstance(status, str) else list(status)
    return [Status(str(s).upper()).to_proto() for s in items]


def _duration(seconds: float) -> duration_pb2.Duration:
    d = duration_pb2.Duration()
    d.FromNanoseconds(int(seconds * 1e9))
    return d


class _ServerHintedWait:
    """Exponential backoff with jitter, but never sooner than the server's RetryInfo asks."""

    def __init__(self, max_delay: float) -> None:
        self._max = max_delay
        self._base = wait_exponential_jitter(initial=0.1, max=max_delay)

    def __call__(self, state: RetryCallState) -> float:
        delay = float(self._base(state))
        exc = state.outcome.exception() if state.outcome is not None else None
        if isinstance(exc, TaskgateError) and exc.retry_delay:
            delay = max(delay, min(exc.retry_delay, self._max))
        return delay


def submit_request(
    prompt: str = "",
    model: str | None = None,
    *,
    frames: int | None = None,
    width: int | None = None,
    height: int | None = None,
    steps: int | None = None,
    guidance: float | None = None,
    fps: int | None = None,
    seed: int | None = None,
    negative_prompt: str = "",
    priority: str | int = "normal",
    idempotency_key: str | None = None,
    callback_url: str | None = None,
    callback_events: Iterable[str] = (),
    metadata: Mapping[str, str] | None = None,
    max_retries: int | None = None,
    task_type: str | None = None,
    image: gateway_pb2.ImageInput | None = None,
    start_after: datetime | None = None,
    max_queue_seconds: float | None = None,
    end_user: str | None = None,
) -> gateway_pb2.SubmitTaskRequest:
    """The SubmitTaskRequest for submit()'s arguments; a fresh idempotency key unless one is given. The task type
    defaults to image-to-video with an image, text-to-video without."""
    params = task_pb2.VideoParams(
        num_frames=frames or 0,
        width=width or 0,
        height=height or 0,
        num_inference_steps=steps or 0,
        guidance_scale=guidance or 0.0,
        fps=fps or 0,
        negative_prompt=negative_prompt,
    )
    if seed is not None:
        params.seed = seed
    request = gateway_pb2.SubmitTaskRequest(
        task_type=task_type or ("image-to-video" if image is not None else "text-to-video"),
        model_id=model or "",
        prompt=prompt,
        params=params,
        priority=priority_value(priority),
        idempotency_key=idempotency_key or str(uuid.uuid4()),
        callback_url=callback_url or "",
        callback_events=list(callback_events),
        metadata=dict(metadata or {}),
        image=image,
        end_user=end_user or "",
    )
    if max_retries is not None:
        request.max_retries = max_retries
    if start_after is not None:
        request.start_after.FromDatetime(start_after if start_after.tzinfo else start_after.astimezone())
    if max_queue_seconds is not None:
        request.max_queue_seconds = max_queue_seconds
    return request


def chat_request(
    messages: ChatInput,
    model: str | None = None,
    *,
    system: str | None = None,
    max_output_tokens: int | None = None,
    temperature: float | None = None,
    top_p: float | None = None,
    stop: Iterable[str] = (),
    seed: int | None = None,
    priority: str | int = "normal",
    idempotency_key: str | None = None,
    callback_url: str | None = None,
    callback_events: Iterable[str] = (),
    metadata: Mapping[str, str] | None = None,
    max_retries: int | None = None,
    start_after: datetime | None = None,
    max_queue_seconds: float | None = None,
    end_user: str | None = None,
) -> gateway_pb2.SubmitTaskRequest:
    """The SubmitTaskRequest of a chat task: `messages` is the user's one message (a str) or the conversation
    ({"role": ..., "content": ...} each, oldest first); `system` goes first as a system message."""
    turns = [{"role": "user", "content": messages}] if isinstance(messages, str) else [dict(m) for m in messages]
    if system is not None:
        turns.insert(0, {"role": "system", "content": system})
    params = task_pb2.ChatParams(
        messages=[
            task_pb2.ChatMessage(role=t.get("role", ""), content=t.get("content", ""), content_sha256=t.get("content_sha256", ""))
            for t in turns
        ],
        stop=list(stop),
    )
    for name, value in (("max_output_tokens", max_output_tokens), ("temperature", temperature), ("top_p", top_p), ("seed", seed)):
        if value is not None:
            setattr(params, name, value)
    request = submit_request(
        "", model, priority=priority, idempotency_key=idempotency_key, callback_url=callback_url,
        callback_events=callback_events, metadata=metadata, max_retries=max_retries, task_type=CHAT,
        start_after=start_after, max_queue_seconds=max_queue_seconds, end_user=end_user,
    )
    request.ClearField("params")
    request.chat.CopyFrom(params)
    return request


def _read_image(image: ImageSource) -> bytes | str:
    """An image source as bytes to send, or as the https URL the gateway fetches."""
    if isinstance(image, bytes):
        return image
    if isinstance(image, str) and image.startswith(("https://", "http://")):
        return image
    return Path(image).read_bytes()


async def _pause_before_resume(
    error: TaskgateError | None, failures: int, limit: int, max_delay: float, ended: str
) -> None:
    """Before resuming a stream after its `failures`-th drop in a row: past `limit`, raises the last error (UNAVAILABLE
    with `ended` when the server just ended it); else waits the server's retry hint or the backoff, the longer."""
    if failures > limit:
        raise error or Unavailable(grpc.StatusCode.UNAVAILABLE, ended)
    hint = error.retry_delay if error is not None and error.retry_delay else 0.0
    await asyncio.sleep(max(hint, min(0.1 * 2 ** (failures - 1), max_delay)))


class AsyncEventStream:
    """WatchTasks as an async iterator of TaskEvent that resumes a dropped stream from its last cursor.

    `cursor` is where a later `watch_all(cursor=...)` resumes: save it after handling each event.
    """

    def __init__(
        self,
        open_stream: Callable[[str], grpc.aio.UnaryStreamCall[events_pb2.WatchTasksRequest, events_pb2.WatchTasksResponse]],
        *,
        cursor: str,
        resume_attempts: int,
        max_delay: float,
    ) -> None:
        self.cursor = cursor
        self._open = open_stream
        self._resume_attempts = resume_attempts
        self._max_delay = max_delay
        self._events = self._follow()

    def __aiter__(self) -> AsyncEventStream:
        return self

    async def __anext__(self) -> TaskEvent:
        return await self._events.__anext__()

    async def aclose(self) -> None:
        """Ends the stream (leaving an `async for` early does not)."""
        await self._events.aclose()

    async def _follow(self) -> AsyncGenerator[TaskEvent, None]:
        seen: OrderedDict[str, int] = OrderedDict()
        failures = 0
        while True:
            call = self._open(self.cursor)
            error: TaskgateError | None = None
            try:
                async for msg in call:
                    failures = 0
                    if msg.cursor:
                        self.cursor = msg.cursor
                    if msg.WhichOneof("kind") != "event" or seen.get(msg.event.task_id, 0) >= msg.event.version:
                        continue
                    seen[msg.event.task_id] = msg.event.version
                    seen.move_to_end(msg.event.task_id)
                    if len(seen) > TRACKED_TASKS:
                        seen.popitem(last=False)
                    yield TaskEvent.from_proto(msg.event)
            except grpc.aio.AioRpcError as exc:
                error = from_rpc_error(exc)
                if exc.code() not in RESUMABLE:
                    raise error from None
            finally:
                call.cancel()
            failures += 1
            await _pause_before_resume(error, failures, self._resume_attempts, self._max_delay, "event stream keeps ending")


class AsyncTaskgateClient:
    """An asyncio client for the gateway (submit), events (notifier) and admin (scheduler) services.

    Use it as `async with AsyncTaskgateClient(config) as client:` or call `await client.close()`.
    """

    def __init__(self, config: ClientConfig) -> None:
        self.config = config.resolved()
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._pipes: dict[str, SubmitPipe] = {}  # the submit stream of each gateway channel
        self.retries = 0
        """How many times a call was retried after UNAVAILABLE or a retryable ABORTED (for metrics and tests)."""

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None) -> None:
        await self.close()

    async def close(self) -> None:
        """Closes every channel; in-flight calls are cancelled."""
        pipes, self._pipes = list(self._pipes.values()), {}
        for pipe in pipes:
            await pipe.close()
        channels, self._channels = list(self._channels.values()), {}
        for channel in channels:
            await channel.close()

    # -- plumbing ---------------------------------------------------------------------------------------------

    def _channel(self, address: str) -> grpc.aio.Channel:
        channel = self._channels.get(address)
        if channel is None:
            creds = self.config.channel_credentials()
            options = self.config.channel_options()
            if creds is None:
                channel = grpc.aio.insecure_channel(channel_target(address), options=options)
            else:
                channel = grpc.aio.secure_channel(channel_target(address), creds, options=options)
            self._channels[address] = channel
        return channel

    @property
    def _gateway(self) -> gateway_pb2_grpc.TaskGatewayAsyncStub:
        return cast("gateway_pb2_grpc.TaskGatewayAsyncStub", gateway_pb2_grpc.TaskGatewayStub(self._channel(self.config.address)))

    @property
    def _events(self) -> events_pb2_grpc.TaskEventsAsyncStub:
        assert self.config.events_address is not None
        return cast("events_pb2_grpc.TaskEventsAsyncStub", events_pb2_grpc.TaskEventsStub(self._channel(self.config.events_address)))

    @property
    def admin_stub(self) -> admin_pb2_grpc.TaskAdminAsyncStub:
        """The raw TaskAdmin stub (pass `admin_metadata` with each call)."""
        assert self.config.admin_address is not None
        return cast("admin_pb2_grpc.TaskAdminAsyncStub", admin_pb2_grpc.TaskAdminStub(self._channel(self.config.admin_address)))

    @property
    def metadata(self) -> tuple[tuple[str, str], ...]:
        """Call metadata carrying the API key, and the caller's trace context when OpenTelemetry is installed."""
        auth = (("authorization", f"Bearer {self.config.api_key}"),) if self.config.api_key else ()
        return auth + tracecontext.metadata()

    @property
    def admin_metadata(self) -> tuple[tuple[str, str], ...]:
        """Call metadata carrying the admin key (the API key when no admin key is set)."""
        key = self.config.admin_key or self.config.api_key
        return ((("authorization", f"Bearer {key}"),) if key else ()) + tracecontext.metadata()

    def _retrying(self) -> AsyncRetrying:
        return AsyncRetrying(
            retry=retry_if_exception(retryable),
            stop=stop_after_attempt(self.config.retry_attempts),
            wait=_ServerHintedWait(self.config.retry_max_delay),
            before_sleep=self._count_retry,
            reraise=True,
        )

    def _count_retry(self, state: RetryCallState) -> None:
        self.retries += 1

    def _handle(self, task: Task) -> AsyncTaskHandle:
        return AsyncTaskHandle.bind(task, self)

    async def _call(self, make: Callable[[], Awaitable[T]]) -> T:
        """Runs one unary call, retrying UNAVAILABLE (and ABORTED with RetryInfo) with backoff; errors become TaskgateError subclasses."""
        async for attempt in self._retrying():
            with attempt:
                try:
                    return await make()
                except grpc.aio.AioRpcError as exc:
                    raise from_rpc_error(exc) from None
        raise AssertionError("unreachable")  # pragma: no cover

    # -- tasks ------------------------------------------------------------------------------------------------

    async def submit(
        self,
        prompt: str,
        model: str | None = None,
        *,
        frames: int | None = None,
        width: int | None = None,
        height: int | None = None,
        steps: int | None = None,
        guidance: float | None = None,
        fps: int | None = None,
        seed: int | None = None,
        negative_prompt: str = "",
        priority: str | int = "normal",
        idempotency_key: str | None = None,
        callback_url: str | None = None,
        callback_events: Iterable[str] = (),
        metadata: Mapping[str, str] | None = None,
        max_retries: int | None = None,
        task_type: str | None = None,
        image: ImageSource | None = None,
        start_after: datetime | None = None,
        max_queue_seconds: float | None = None,
        end_user: str | None = None,
    ) -> AsyncTaskHandle:
        """Submits a task and returns its handle. Unset parameters take the model's defaults.

        With `image` (a file's path, its bytes, or an https URL the gateway fetches) the task is image-to-video
        unless `task_type` says otherwise; a file larger than INLINE_IMAGE_BYTES is uploaded first (UploadInput).
        Without `idempotency_key` a fresh one is generated once per call, so the built-in retries never create
        a second task; pass your own to make retries across processes safe as well. `start_after` delays the start
        (no worker takes the task before it); `max_queue_seconds` is its queue TTL: a task no worker took in time ends
        TIMEOUT with error_code QUEUE_TTL_EXPIRED instead of running late. `end_user`: your own user the task is for
        (opaque, at most 128 bytes); its limits, idempotency keys, fair share and usage are its own inside yours.
        """
        request = submit_request(
            prompt, model, frames=frames, width=width, height=height, steps=steps, guidance=guidance, fps=fps, seed=seed,
            negative_prompt=negative_prompt, priority=priority, idempotency_key=idempotency_key,
            callback_url=callback_url, callback_events=callback_events, metadata=metadata, max_retries=max_retries,
            task_type=task_type, image=await self._image_input(image), start_after=start_after,
            max_queue_seconds=max_queue_seconds, end_user=end_user,
        )
        response = await self._submit_one(request)
        return self._handle(Task.from_proto(response.task, created=response.created))

    async def chat(self, messages: ChatInput, model: str | None = None, **options: Unpack[ChatOptions]) -> AsyncTaskHandle:
        """Submits a chat task (task_type "chat") and returns its handle: `messages` is one user message or the
        conversation (dicts of role and content, oldest first, ending with the user's); `system` (an option) goes
        first. Unset options take the model's defaults: `max_output_tokens`, `temperature` (0: greedy), `top_p`,
        `stop` (strings that end the answer), `seed`; the others are submit()'s. The finished task's `answer` holds
        the text (inline up to the gateway's size setting; `download` writes it all)."""
        request = chat_request(messages, model, **options)
        response = await self._submit_one(request)
        return self._handle(Task.from_proto(response.task, created=response.created))

    async def submit_many(
        self,
        items: Iterable[SubmitItem],
        *,
        chunk_size: int = MAX_SUBMIT_BATCH,
        on_progress: Callable[[int, int], Any] | None = None,
    ) -> builtins.list[AsyncTaskHandle | TaskgateError]:
        """Submits many tasks with SubmitTasks (`chunk_size` per call, 1,000 at most): one result per item, in order,
        its handle or the error that refused it alone. `on_progress(done, total)` runs after each call.

        An item without `idempotency_key` gets a fresh one, so a retried call never creates a task twice. A call that
        fails as a whole (UNAVAILABLE after the retries, say) raises.
        """
        if not 1 <= chunk_size <= MAX_SUBMIT_BATCH:
            raise ValueError(f"chunk_size must be 1 to {MAX_SUBMIT_BATCH}")
        requests = [
            submit_request(**cast("dict[str, Any]", {**item, "image": await self._image_input(item.get("image"))}))
            for item in items
        ]
        out: builtins.list[AsyncTaskHandle | TaskgateError] = []
        for start in range(0, len(requests), chunk_size):
            response = await self._submit_chunk(gateway_pb2.SubmitTasksRequest(requests=requests[start:start + chunk_size]))
            for result in response.results:
                if result.HasField("error"):
                    out.append(from_status(result.error))
                else:
                    out.append(self._handle(Task.from_proto(result.response.task, created=result.response.created)))
            if on_progress is not None:
                on_progress(len(out), len(requests))
        return out

    async def upload_input(self, image: ImageSource) -> InputImage:
        """Stores an input image (a file's path or its bytes) with UploadInput, in parts; a later submit can name it
        by the returned sha256 as `image=` would (submit does this by itself for a large file)."""
        data = await asyncio.to_thread(_read_image, image)
        if isinstance(data, str):
            raise ValueError("upload_input takes a file or its bytes, not a URL")

        async def parts() -> AsyncIterator[gateway_pb2.UploadInputRequest]:
            for offset in range(0, max(len(data), 1), UPLOAD_PART):
                yield gateway_pb2.UploadInputRequest(data=data[offset : offset + UPLOAD_PART])

        response = await self._call(
            lambda: self._gateway.UploadInput(parts(), metadata=self.metadata, timeout=self.config.call_timeout)
        )
        return InputImage.from_proto(response.image)

    async def upload_text(self, text: str | bytes | os.PathLike[str]) -> InputText:
        """Stores a text attachment for chat tasks (a str, UTF-8 bytes, or a file's path) with UploadInput, in parts;
        a chat message names it by the returned sha256 (`content_sha256`), and the gateway appends its text to the
        message's content when it admits the task (counted like inline text)."""
        if isinstance(text, str):
            data = text.encode("utf-8")
        elif isinstance(text, bytes):
            data = text
        else:
            data = await asyncio.to_thread(Path(text).read_bytes)

        async def parts() -> AsyncIterator[gateway_pb2.UploadInputRequest]:
            for offset in range(0, max(len(data), 1), UPLOAD_PART):
                part = gateway_pb2.UploadInputRequest(data=data[offset : offset + UPLOAD_PART])
                if offset == 0:
                    part.content_type = "text/plain"
                yield part

        response = await self._call(
            lambda: self._gateway.UploadInput(parts(), metadata=self.metadata, timeout=self.config.call_timeout)
        )
        return InputText.from_proto(response.text)

    async def _image_input(self, image: ImageSource | None) -> gateway_pb2.ImageInput | None:
        """The wire form of a submit's image: the URL, the bytes inline, or a reference to their upload."""
        if image is None:
            return None
        data = await asyncio.to_thread(_read_image, image)
        if isinstance(data, str):
            return gateway_pb2.ImageInput(url=data)
        if len(data) <= INLINE_IMAGE_BYTES:
            return gateway_pb2.ImageInput(data=data)
        return gateway_pb2.ImageInput(upload_sha256=(await self.upload_input(data)).sha256)

    async def _submit_one(self, request: gateway_pb2.SubmitTaskRequest) -> gateway_pb2.SubmitTaskResponse:
        """One submission, retried as any call: over the channel's SubmitStream (pipelined with the other submit()s
        in flight), or by SubmitTask where the server has no stream."""
        if not self.config.submit_stream:
            return await self._call(
                lambda: self._gateway.SubmitTask(request, metadata=self.metadata, timeout=self.config.call_timeout)
            )
        pipe = self._pipe()

        async def once() -> gateway_pb2.SubmitTaskResponse:
            try:
                return await pipe.submit(request, self.config.call_timeout, dict(tracecontext.metadata()))
            except StreamUnavailable:
                return await self._gateway.SubmitTask(request, metadata=self.metadata, timeout=self.config.call_timeout)

        return await self._call(once)

    def _pipe(self) -> SubmitPipe:
        address = self.config.address
        pipe = self._pipes.get(address)
        if pipe is None:
            auth = (("authorization", f"Bearer {self.config.api_key}"),) if self.config.api_key else ()
            pipe = self._pipes[address] = SubmitPipe(lambda requests: self._gateway.SubmitStream(requests, metadata=auth))
        return pipe

    async def _submit_chunk(self, request: gateway_pb2.SubmitTasksRequest) -> gateway_pb2.SubmitTasksResponse:
        return await self._call(
            lambda: self._gateway.SubmitTasks(request, metadata=self.metadata, timeout=self.config.call_timeout)
        )

    async def get_with_interval(self, task_id: str) -> tuple[Task, float]:
        """The task and how long the gateway suggests waiting before polling it again (seconds)."""
        request = gateway_pb2.GetTaskRequest(task_id=task_id)
        response = await self._call(
            lambda: self._gateway.GetTask(request, metadata=self.metadata, timeout=self.config.call_timeout)
        )
        interval = response.suggested_poll_interval.ToNanoseconds() / 1e9 if response.HasField("suggested_poll_interval") else 0
        return Task.from_proto(response.task), interval or DEFAULT_POLL_SECONDS

    async def get(self, task_id: str) -> AsyncTaskHandle:
        """The task's current state."""
        return self._handle((await self.get_with_interval(task_id))[0])

    async def list(self, status: StatusFilter = None, *, page_size: int = 100) -> AsyncIterator[AsyncTaskHandle]:
        """The caller's tasks, newest first, fetching pages as the iteration goes."""
        token = ""
        while True:
            request = gateway_pb2.ListTasksRequest(statuses=_statuses(status), page_size=page_size, page_token=token)
            response = await self._call(
                lambda r=request: self._gateway.ListTasks(r, metadata=self.metadata, timeout=self.config.call_timeout)  # type: ignore[misc]
            )
            for msg in response.tasks:
                yield self._handle(Task.from_proto(msg))
            token = response.next_page_token
            if not token:
                return

    async def cancel(self, task_id: str, hard: bool = False) -> AsyncTaskHandle:
        """Cancels a task. Soft (default): a running task finishes and its output is kept for reuse; hard: stops now."""
        request = gateway_pb2.CancelTaskRequest(task_id=task_id, hard=hard)
        response = await self._call(
            lambda: self._gateway.CancelTask(request, metadata=self.metadata, timeout=self.config.call_timeout)
        )
        return self._handle(Task.from_proto(response.task))

    async def client_token_secret(self, *, rotate: bool = False, overlap: float = 3600.0) -> str:
        """Your tenant's client-token secret, for `mint_client_token` (offline); `rotate`: a new one, tokens of the old
        one staying valid for `overlap` seconds. A rotation is not retried (a lost answer would rotate again)."""
        request = gateway_pb2.GetClientTokenSecretRequest(rotate=rotate)
        if rotate:
            request.overlap.CopyFrom(_duration(overlap))
            try:
                response = await self._gateway.GetClientTokenSecret(
                    request, metadata=self.metadata, timeout=self.config.call_timeout
                )
            except grpc.aio.AioRpcError as exc:
                raise from_rpc_error(exc) from None
        else:
            response = await self._call(
                lambda: self._gateway.GetClientTokenSecret(request, metadata=self.metadata, timeout=self.config.call_timeout)
            )
        return response.secret

    async def create_client_token(
        self, end_user: str, *, scopes: Iterable[str] = ("read", "watch"), task_ids: Iterable[str] = (),
        ttl_seconds: float = 900.0,
    ) -> str:
        """A short-lived token for one end user's tasks (GetTask, results, events; cancel with the "cancel" scope),
        minted by the gateway (CreateClientToken); `mint_client_token` makes the same offline."""
        request = gateway_pb2.CreateClientTokenRequest(
            end_user=end_user, scopes=list(scopes), task_ids=list(task_ids), ttl=_duration(ttl_seconds)
        )
        response = await self._call(
            lambda: self._gateway.CreateClientToken(request, metadata=self.metadata, timeout=self.config.call_timeout)
        )
        return response.token

    async def regenerate(self, task_id: str, *, seed: int | None = None, idempotency_key: str | None = None) -> AsyncTaskHandle:
        """A new task from a finished one's request: a new seed (random unless given), at HIGH when the tenant may use it.

        Without `idempotency_key` a fresh one is generated once per call, so the built-in retries make one task only.
        """
        request = gateway_pb2.RegenerateTaskRequest(task_id=task_id, idempotency_key=idempotency_key or str(uuid.uuid4()))
        if seed is not None:
            request.seed = seed
        response = await self._call(
            lambda: self._gateway.RegenerateTask(request, metadata=self.metadata, timeout=self.config.call_timeout)
        )
        return self._handle(Task.from_proto(response.task, created=response.created))

    async def rotate_own_webhook_secret(
        self, *, overlap: float = 24 * 3600.0
    ) -> gateway_pb2.TaskGatewayRotateWebhookSecretResponse:
        """A new webhook secret for your own tenant (shown once); the current ones keep signing for `overlap` seconds.

        Not retried: a retry after a lost answer would rotate again and the secret shown first would be lost.
        """
        request = gateway_pb2.TaskGatewayRotateWebhookSecretRequest(overlap=_duration(overlap))
        try:
            return await self._gateway.RotateWebhookSecret(request, metadata=self.metadata, timeout=self.config.call_timeout)
        except grpc.aio.AioRpcError as exc:
            raise from_rpc_error(exc) from None

    async def watch(self, task_id: str, *, after_version: int = 0, resume_attempts: int | None = None) -> AsyncIterator[TaskEvent]:
        """The task's snapshot, then each later event, until it is terminal.

        A dropped stream (UNAVAILABLE, ABORTED, ...) is resumed with the last version seen, so no event is
        skipped or repeated; after `resume_attempts` failures in a row the last error is raised.
        """
        last = after_version
        limit = self.config.watch_resume_attempts if resume_attempts is None else resume_attempts
        failures = 0
        while True:
            call = self._events.WatchTask(
                events_pb2.WatchTaskRequest(task_id=task_id, after_version=last), metadata=self.metadata
            )
            error: TaskgateError | None = None
            try:
                async for msg in call:
                    kind = msg.WhichOneof("kind")
                    if kind == "snapshot":
                        event = TaskEvent.from_snapshot(msg.snapshot)
                    elif kind == "event":
                        event = TaskEvent.from_proto(msg.event)
                    else:
                        continue
                    if event.version <= last:
                        continue
                    last, failures = event.version, 0
                    yield event
                    if event.terminal:
                        return
            except grpc.aio.AioRpcError as exc:
                error = from_rpc_error(exc)
                if exc.code() not in RESUMABLE:
                    raise error from None
            finally:
                call.cancel()
            if error is None:
                # The server ended the stream without a terminal event: maybe we resumed after the end.
                task = await self.get(task_id)
                if task.terminal:
                    if task.version > last:
                        yield TaskEvent.from_snapshot(task.proto)
                    return
            failures += 1
            await _pause_before_resume(error, failures, limit, self.config.retry_max_delay, "event stream keeps ending early")

    async def output(
        self, task_id: str, *, after_sequence: int = 0, resume_attempts: int | None = None
    ) -> AsyncIterator[Output]:
        """The task's partial output (text deltas, previews, log lines) from `after_sequence` on, in order, until the
        task is terminal (its chunks stored before that all come first).

        A dropped stream is resumed from the last version and the last chunk's sequence, so no chunk is skipped or
        repeated; after `resume_attempts` failures in a row the last error is raised.
        """
        version, sequence = 0, after_sequence
        limit = self.config.watch_resume_attempts if resume_attempts is None else resume_attempts
        failures = 0
        while True:
            request = events_pb2.WatchTaskRequest(
                task_id=task_id, after_version=version, include_output=True, after_output_sequence=sequence
            )
            call = self._events.WatchTask(request, metadata=self.metadata)
            error: TaskgateError | None = None
            ended = False
            try:
                async for msg in call:
                    kind = msg.WhichOneof("kind")
                    if kind == "output":
                        if msg.output.sequence <= sequence:
                            continue
                        sequence, failures = msg.output.sequence, 0
                        yield Output.from_proto(msg.output)
                    elif kind == "snapshot":
                        version = max(version, msg.snapshot.version)
                        ended = Status.from_proto(msg.snapshot.status).terminal
                    elif kind == "event":
                        version = max(version, msg.event.version)
                        ended = Status.from_proto(msg.event.to_status).terminal
                if ended:
                    return  # the server ended the stream after the terminal state: the output is complete
            except grpc.aio.AioRpcError as exc:
                error = from_rpc_error(exc)
                if exc.code() not in RESUMABLE:
                    raise error from None
            finally:
                call.cancel()
            if error is None and (await self.get(task_id)).terminal:
                return  # resumed after the end: the server sent what was left of the output, then ended
            failures += 1
            await _pause_before_resume(error, failures, limit, self.config.retry_max_delay, "output stream keeps ending early")

    async def stream_text(self, task_id: str, *, resume_attempts: int | None = None) -> AsyncIterator[TextDelta]:
        """The task's text as it is generated, one delta (a `str`) at a time, until the task ends; a delta with
        `restarted` set begins a newer attempt's text at its `offset` (see TextDelta)."""
        text = TextAssembler()
        async for chunk in self.output(task_id, resume_attempts=resume_attempts):
            if (delta := text.feed(chunk)) is not None:
                yield delta

    async def previews(
        self, task_id: str, *, fetch: bool = True, after_sequence: int = 0, resume_attempts: int | None = None
    ) -> AsyncIterator[Preview]:
        """The preview images of a running video as they are made, in order, until the task ends; each with its bytes
        when `fetch` (None for one already deleted), else only where it is (`preview_bytes` reads it)."""
        async for chunk in self.output(task_id, after_sequence=after_sequence, resume_attempts=resume_attempts):
            if chunk.kind != "preview":
                continue
            data = None
            if fetch:
                with contextlib.suppress(NotFound):  # deleted since (retention): the reference still says what it was
                    data = await self.preview_bytes(task_id, chunk.uri)
            yield Preview.of(chunk, data)

    async def preview_bytes(self, task_id: str, uri: str) -> bytes:
        """One preview image of the task (a Preview's or a preview Output's `uri`), read through the gateway."""
        request = gateway_pb2.GetTaskResultRequest(task_id=task_id, preview_uri=uri)
        async for attempt in self._retrying():
            with attempt:
                data = bytearray()
                call = self._gateway.GetTaskResult(request, metadata=self.metadata)
                try:
                    async for chunk in call:
                        data += chunk.data
                except grpc.aio.AioRpcError as exc:
                    raise from_rpc_error(exc) from None
                return bytes(data)
        raise AssertionError("unreachable")  # pragma: no cover

    async def logs(self, task_id: str, *, after_sequence: int = 0, resume_attempts: int | None = None) -> AsyncIterator[Output]:
        """The worker's log lines about the task (model load, warm-up, each phase's seconds) as they come, until it ends."""
        async for chunk in self.output(task_id, after_sequence=after_sequence, resume_attempts=resume_attempts):
            if chunk.kind == "log":
                yield chunk

    async def text(self, task_id: str, timeout: float | None = None) -> str:
        """A chat task's whole answer once it SUCCEEDED: inline from GetTask, else read with GetTaskResult.

        Raises TaskFailed when it ended otherwise, WaitTimeout when it is still running after `timeout`."""
        done = await self.wait(task_id, timeout)
        if done.status is not Status.SUCCEEDED:
            raise TaskFailed(done)
        if done.answer is not None and not done.answer.truncated:
            return done.answer.text
        data = bytearray()
        async for attempt in self._retrying():
            with attempt:
                data.clear()
                call = self._gateway.GetTaskResult(gateway_pb2.GetTaskResultRequest(task_id=task_id), metadata=self.metadata)
                try:
                    async for chunk in call:
                        data += chunk.data
                except grpc.aio.AioRpcError as exc:
                    raise from_rpc_error(exc) from None
        return data.decode("utf-8", errors="replace")

    def watch_all(
        self, status: StatusFilter = None, *, cursor: str | None = None, resume_attempts: int | None = None
    ) -> AsyncEventStream:
        """Every event of the caller's tasks (into the `status` states; None: all) from `cursor` on (None: from now).

        The stream starts at its first iteration and never ends by itself. A dropped stream is resumed from the last
        cursor and skips what it already yielded; after `resume_attempts` failures in a row the last error is raised.
        A new stream from a saved cursor may repeat a few events from just before it (ids commit out of order).
        """
        statuses = _statuses(status)

        def open_stream(after: str) -> grpc.aio.UnaryStreamCall[events_pb2.WatchTasksRequest, events_pb2.WatchTasksResponse]:
            request = events_pb2.WatchTasksRequest(statuses=statuses, cursor=after)
            return self._events.WatchTasks(request, metadata=self.metadata)

        limit = self.config.watch_resume_attempts if resume_attempts is None else resume_attempts
        return AsyncEventStream(open_stream, cursor=cursor or "", resume_attempts=limit, max_delay=self.config.retry_max_delay)

    async def run(
        self,
        prompt: str,
        model: str | None = None,
        *,
        output: str | os.PathLike[str],
        timeout: float | None = None,
        on_event: Callable[[TaskEvent], Any] | None = None,
        **options: Unpack[SubmitOptions],
    ) -> AsyncTaskHandle:
        """Submits, follows the task until it ends and writes its output to `output`; returns the finished task.

        Raises TaskFailed when it ended without a result, WaitTimeout after `timeout` seconds (the task goes on).
        """
        task = await self.submit(prompt, model, **options)
        done = await task.wait(timeout, on_event=on_event)
        await done.download(output)
        return done

    async def wait(
        self,
        task_id: str,
        timeout: float | None = None,
        *,
        on_event: Callable[[TaskEvent], Any] | None = None,
    ) -> AsyncTaskHandle:
        """Waits until the task is terminal and returns it: follows the event stream, or polls if it is unusable.

        Raises WaitTimeout after `timeout` seconds (None: no limit). `on_event` sees each event (or polled state).
        """
        try:
            async with compat.timeout(timeout):
                try:
                    async for event in self.watch(task_id, resume_attempts=2):
                        if on_event is not None:
                            on_event(event)
                        if event.terminal:
                            return await self.get(task_id)
                except TaskgateError as exc:
                    if exc.code not in POLL_INSTEAD:
                        raise
                return await self._poll(task_id, on_event)
        except TimeoutError:
            raise WaitTimeout(task_id, timeout or 0.0) from None

    async def _poll(self, task_id: str, on_event: Callable[[TaskEvent], Any] | None) -> AsyncTaskHandle:
        while True:
            task, interval = await self.get_with_interval(task_id)
            if on_event is not None:
                on_event(TaskEvent.from_snapshot(task.proto))
            if task.terminal:
                return self._handle(task)
            await asyncio.sleep(interval)

    async def download(self, task_id: str, path: str | os.PathLike[str]) -> TaskResult:
        """Saves a SUCCEEDED task's output into `path` (from its result URL when it has one, else streamed over gRPC)
        and checks its size and sha256 (IntegrityError if not)."""
        target = Path(path)
        task, _ = await self.get_with_interval(task_id)
        if task.result is not None and task.result.url.startswith(("https://", "http://")):
            try:
                return await asyncio.to_thread(_fetch_url, task.result, target, self.config.call_timeout)
            except (urllib.error.URLError, OSError):
                pass  # an expired or unreachable URL: the gateway still streams the output
        async for attempt in self._retrying():
            with attempt:
                return await self._download_once(task_id, target)
        raise AssertionError("unreachable")  # pragma: no cover

    async def _download_once(self, task_id: str, target: Path) -> TaskResult:
        partial = target.with_name(target.name + ".part")
        call = self._gateway.GetTaskResult(gateway_pb2.GetTaskResultRequest(task_id=task_id), metadata=self.metadata)
        info: TaskResult | None = None
        digest = hashlib.sha256()
        size = 0
        complete = False
        out = await asyncio.to_thread(partial.open, "wb")
        try:
            async for chunk in call:
                if chunk.HasField("info"):
                    info = TaskResult.from_proto(chunk.info)
                if chunk.offset != size:
                    raise IntegrityError(grpc.StatusCode.DATA_LOSS, f"chunk at offset {chunk.offset}, expected {size}")
                digest.update(chunk.data)
                size += len(chunk.data)
                await asyncio.to_thread(out.write, chunk.data)
            if info is None:
                raise IntegrityError(grpc.StatusCode.DATA_LOSS, "the result stream carried no result info")
            _check_integrity(info, size, digest)
            complete = True
        except grpc.aio.AioRpcError as exc:
            raise from_rpc_error(exc) from None
        finally:
            call.cancel()
            out.close()
            if not complete:
                partial.unlink(missing_ok=True)
        partial.replace(target)
        return info

    # -- admin (needs an admin key) ---------------------------------------------------------------------------

    async def stats(self) -> admin_pb2.GetStatsResponse:
        """Task counts per model and state, the oldest queued age, workers and callback counts."""
        return await self._call(
            lambda: self.admin_stub.GetStats(
                admin_pb2.GetStatsRequest(), metadata=self.admin_metadata, timeout=self.config.call_timeout
            )
        )

    async def stuck(self, limit: int = 100) -> builtins.list[admin_pb2.StuckTask]:
        """Tasks the scheduler considers stuck, each with why."""
        response = await self._call(
            lambda: self.admin_stub.ListStuckTasks(
                admin_pb2.ListStuckTasksRequest(limit=limit), metadata=self.admin_metadata, timeout=self.config.call_timeout
            )
        )
        return list(response.tasks)

    async def requeue(
        self,
        task_ids: Iterable[str] = (),
        *,
        status: StatusFilter = None,
        model: str | None = None,
        older_than: float | None = None,
        dry_run: bool = False,
        batch_size: int = 50,
        reason: str = "",
        replay_finished: bool = False,
    ) -> AsyncIterator[admin_pb2.RequeueBatch]:
        """Requeues the given tasks (or those matching the filter) in batches, yielding each batch's report.

        FAILED and TIMEOUT tasks stay terminal: with `replay_finished` each is replayed once as a new task with the same
        request and seed (item action REPLAYED, detail "as task <id>"), created past its tenant's limits and dispatched
        at once; without it they are SKIPPED, as SUCCEEDED and CANCELED tasks always are.
        """
        request = admin_pb2.RequeueTasksRequest(
            task_ids=list(task_ids), dry_run=dry_run, batch_size=batch_size, reason=reason, replay_finished=replay_finished
        )
        if status is not None or model or older_than is not None:
            request.filter.CopyFrom(admin_pb2.TaskFilter(statuses=_statuses(status), model_id=model or ""))
            if older_than is not None:
                request.filter.older_than.CopyFrom(_duration(older_than))
        call = self.admin_stub.RequeueTasks(request, metadata=self.admin_metadata)
        try:
            async for batch in call:
                yield batch
        except grpc.aio.AioRpcError as exc:
            raise from_rpc_error(exc) from None
        finally:
            call.cancel()

    async def dead_letters(self, *, page_size: int = 100) -> AsyncIterator[admin_pb2.DeadLetter]:
        """Tasks that failed for good, newest first, fetching pages as the iteration goes."""
        token = ""
        while True:
            request = admin_pb2.ListDeadLettersRequest(page_size=page_size, page_token=token)
            response = await self._call(
                lambda r=request: self.admin_stub.ListDeadLetters(  # type: ignore[misc]
                    r, metadata=self.admin_metadata, timeout=self.config.call_timeout
                )
            )
            for item in response.dead_letters:
                yield item
            token = response.next_page_token
            if not token:
                return

    async def redeliver(self, task_id: str) -> builtins.list[admin_pb2.CallbackDelivery]:
        """Sends a task's callbacks again (failed or delivered); returns the deliveries scheduled."""
        response = await self._call(
            lambda: self.admin_stub.RedeliverCallback(
                admin_pb2.RedeliverCallbackRequest(task_id=task_id), metadata=self.admin_metadata, timeout=self.config.call_timeout
            )
        )
        return list(response.deliveries)

    async def deliveries(self, status: str | None = None, *, page_size: int = 100) -> AsyncIterator[admin_pb2.DeliveryRecord]:
        """Webhook deliveries in a state (PENDING, DELIVERED, FAILED; None: all), newest first, with attempts and last error."""
        wanted = task_pb2.CallbackStatus.Value(f"CALLBACK_STATUS_{status.upper()}") if status else 0
        token = ""
        while True:
            request = admin_pb2.ListCallbackDeliveriesRequest(status=wanted, page_size=page_size, page_token=token)  # type: ignore[arg-type]
            response = await self._call(
                lambda r=request: self.admin_stub.ListCallbackDeliveries(  # type: ignore[misc]
                    r, metadata=self.admin_metadata, timeout=self.config.call_timeout
                )
            )
            for item in response.deliveries:
                yield item
            token = response.next_page_token
            if not token:
                return

    async def audit(self, admin: str | None = None, *, page_size: int = 100) -> AsyncIterator[admin_pb2.AuditEvent]:
        """What admins did (one admin's when given), newest first: who, what, on what, when, dry run or not."""
        token = ""
        while True:
            request = admin_pb2.ListAuditEventsRequest(admin=admin or "", page_size=page_size, page_token=token)
            response = await self._call(
                lambda r=request: self.admin_stub.ListAuditEvents(  # type: ignore[misc]
                    r, metadata=self.admin_metadata, timeout=self.config.call_timeout
                )
            )
            for item in response.events:
                yield item
            token = response.next_page_token
            if not token:
                return

    async def rotate_webhook_secret(self, tenant: str, *, overlap: float = 24 * 3600.0) -> admin_pb2.RotateWebhookSecretResponse:
        """A new webhook secret for `tenant` (shown once); its current ones keep signing for `overlap` seconds.

        Not retried: a retry after a lost answer would rotate again and the secret shown first would be lost.
        """
        request = admin_pb2.RotateWebhookSecretRequest(tenant=tenant, overlap=_duration(overlap))
        try:
            return await self.admin_stub.RotateWebhookSecret(request, metadata=self.admin_metadata, timeout=self.config.call_timeout)
        except grpc.aio.AioRpcError as exc:
            raise from_rpc_error(exc) from None

    async def api_keys(self, tenant: str | None = None) -> builtins.list[admin_pb2.ApiKeyInfo]:
        """Every API key (of `tenant` when given) by prefix, newest first."""
        request = admin_pb2.ListApiKeysRequest(tenant=tenant or "")
        response = await self._call(
            lambda: self.admin_stub.ListApiKeys(request, metadata=self.admin_metadata, timeout=self.config.call_timeout)
        )
        return list(response.keys)

    async def revoke_api_keys(self, prefix: str) -> int:
        """Revokes the live keys with a prefix (as `api_keys` lists it); how many. NotFound when none is live."""
        request = admin_pb2.RevokeApiKeysRequest(prefix=prefix)
        response = await self._call(
            lambda: self.admin_stub.RevokeApiKeys(request, metadata=self.admin_metadata, timeout=self.config.call_timeout)
        )
        return response.revoked

    async def usage(
        self, tenant: str | None = None, *, since: datetime | None = None, until: datetime | None = None,
        by_hour: bool = False, by_end_user: bool = False, end_user: str | None = None,
    ) -> admin_pb2.GetUsageResponse:
        """Metered GPU-seconds and slot seconds per tenant and model (per UTC hour with `by_hour`, per end user with
        `by_end_user`; `end_user`: only that one of `tenant`'s) from `since`'s hour (default: 24 hours ago) to before
        `until` (default: now)."""
        request = admin_pb2.GetUsageRequest(tenant=tenant or "", by_hour=by_hour, by_end_user=by_end_user)
        if end_user is not None:
            request.end_user = end_user
        if since is not None:
            request.since.FromDatetime(since)
        if until is not None:
            request.until.FromDatetime(until)
        return await self._call(
            lambda: self.admin_stub.GetUsage(request, metadata=self.admin_metadata, timeout=self.config.call_timeout)
        )

    async def purge(self, older_than: float, *, dry_run: bool = False) -> admin_pb2.PurgeTasksResponse:
        """Deletes finished tasks (with their history and outputs) and reusable outputs older than `older_than`
        seconds; `dry_run` only counts. Not retried: a purge cut short is safe to ask for again."""
        request = admin_pb2.PurgeTasksRequest(older_than=_duration(older_than), dry_run=dry_run)
        try:
            return await self.admin_stub.PurgeTasks(request, metadata=self.admin_metadata)
        except grpc.aio.AioRpcError as exc:
            raise from_rpc_error(exc) from None


def _check_integrity(info: TaskResult, size: int, digest: Any) -> None:
    if size != info.size_bytes or digest.hexdigest() != info.sha256:
        raise IntegrityError(
            grpc.StatusCode.DATA_LOSS,
            f"downloaded {size} bytes with sha256 {digest.hexdigest()[:16]}…, "
            f"expected {info.size_bytes} bytes with sha256 {info.sha256[:16]}…",
            reason=reasons.CHECKSUM_MISMATCH,
        )


def _fetch_url(info: TaskResult, target: Path, timeout: float) -> TaskResult:
    """GETs the output from its result URL into `target` (blocking; run in a thread), checking size and sha256."""
    partial = target.with_name(target.name + ".part")
    digest = hashlib.sha256()
    size = 0
    complete = False
    try:
        with urllib.request.urlopen(info.url, timeout=timeout) as response, partial.open("wb") as out:
            while chunk := response.read(DOWNLOAD_CHUNK):
                digest.update(chunk)
                size += len(chunk)
                out.write(chunk)
        _check_integrity(info, size, digest)
        complete = True
    finally:
        if not complete:
            partial.unlink(missing_ok=True)
    partial.replace(target)
    return info


def connect_async(
    address: str | None = None, api_key: str | None = None, **options: Unpack[ConnectOptions]
) -> AsyncTaskgateClient:
    """An asyncio client. Events default to port 50052 and admin to 50053 on the gateway's host.

    Certificates may be PEM bytes or file paths; giving any of them turns TLS on.
    """
    return AsyncTaskgateClient(
        make_config(address, api_key, **options)
    )


__all__ = ["AsyncTaskgateClient", "connect_async"]
