"""The asyncio client: submit, follow, cancel and download tasks; admin calls for operators."""

from __future__ import annotations

import asyncio
import builtins
import hashlib
import os
import urllib.error
import uuid
from collections.abc import AsyncIterator, Callable, Iterable, Mapping
from datetime import datetime
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any, cast

import grpc

from taskgate_api.v1 import gateway_pb2
from taskgate_client import tracecontext
from taskgate_client.admin import AdminCalls
from taskgate_client.config import ConnectOptions, make_config
from taskgate_client.downloads import check_integrity, fetch_url
from taskgate_client.errors import IntegrityError, TaskgateError, from_rpc_error, from_status
from taskgate_client.follow import FollowCalls
from taskgate_client.handles import AsyncTaskHandle
from taskgate_client.messages import StatusFilter, chat_request, duration, read_image, submit_request, wire_statuses
from taskgate_client.pipeline import StreamUnavailable, SubmitPipe
from taskgate_client.resume import AsyncEventStream
from taskgate_client.types import (
    ChatInput,
    ChatOptions,
    ImageSource,
    InputImage,
    InputText,
    SubmitItem,
    SubmitOptions,
    Task,
    TaskEvent,
    TaskResult,
)

if TYPE_CHECKING:  # 3.11 typing names, in annotations only: the client also runs on 3.10
    from typing import Self, Unpack

MAX_SUBMIT_BATCH = 1000  # tasks per SubmitTasks call, the gateway's limit
# an image file up to this size travels in the request; a larger one is uploaded first
INLINE_IMAGE_BYTES = 2 * 1024 * 1024
UPLOAD_PART = 1024 * 1024


class AsyncTaskgateClient(FollowCalls, AdminCalls):
    """An asyncio client for the gateway (submit), events (notifier) and admin (scheduler) services.

    Use it as `async with AsyncTaskgateClient(config) as client:` or call `await client.close()`.
    (Its plumbing is ClientCore in channels.py; following tasks is FollowCalls in follow.py; the admin calls are
    AdminCalls in admin.py.)
    """

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

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
            prompt,
            model,
            frames=frames,
            width=width,
            height=height,
            steps=steps,
            guidance=guidance,
            fps=fps,
            seed=seed,
            negative_prompt=negative_prompt,
            priority=priority,
            idempotency_key=idempotency_key,
            callback_url=callback_url,
            callback_events=callback_events,
            metadata=metadata,
            max_retries=max_retries,
            task_type=task_type,
            image=await self._image_input(image),
            start_after=start_after,
            max_queue_seconds=max_queue_seconds,
            end_user=end_user,
        )
        response = await self._submit_one(request)
        return self._handle(Task.from_proto(response.task, created=response.created))

    async def chat(
        self, messages: ChatInput, model: str | None = None, **options: Unpack[ChatOptions]
    ) -> AsyncTaskHandle:
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
            response = await self._submit_chunk(
                gateway_pb2.SubmitTasksRequest(requests=requests[start : start + chunk_size])
            )
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
        data = await asyncio.to_thread(read_image, image)
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
        data = await asyncio.to_thread(read_image, image)
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
            pipe = self._pipes[address] = SubmitPipe(
                lambda requests: self._gateway.SubmitStream(requests, metadata=auth)
            )
        return pipe

    async def _submit_chunk(self, request: gateway_pb2.SubmitTasksRequest) -> gateway_pb2.SubmitTasksResponse:
        return await self._call(
            lambda: self._gateway.SubmitTasks(request, metadata=self.metadata, timeout=self.config.call_timeout)
        )

    async def list(self, status: StatusFilter = None, *, page_size: int = 100) -> AsyncIterator[AsyncTaskHandle]:
        """The caller's tasks, newest first, fetching pages as the iteration goes."""
        token = ""
        while True:
            request = gateway_pb2.ListTasksRequest(
                statuses=wire_statuses(status), page_size=page_size, page_token=token
            )
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
            request.overlap.CopyFrom(duration(overlap))
            try:
                response = await self._gateway.GetClientTokenSecret(
                    request, metadata=self.metadata, timeout=self.config.call_timeout
                )
            except grpc.aio.AioRpcError as exc:
                raise from_rpc_error(exc) from None
        else:
            response = await self._call(
                lambda: self._gateway.GetClientTokenSecret(
                    request, metadata=self.metadata, timeout=self.config.call_timeout
                )
            )
        return response.secret

    async def create_client_token(
        self, end_user: str, *, scopes: Iterable[str] = ("read", "watch"), task_ids: Iterable[str] = (),
        ttl_seconds: float = 900.0,
    ) -> str:
        """A short-lived token for one end user's tasks (GetTask, results, events; cancel with the "cancel" scope),
        minted by the gateway (CreateClientToken); `mint_client_token` makes the same offline."""
        request = gateway_pb2.CreateClientTokenRequest(
            end_user=end_user, scopes=list(scopes), task_ids=list(task_ids), ttl=duration(ttl_seconds)
        )
        response = await self._call(
            lambda: self._gateway.CreateClientToken(request, metadata=self.metadata, timeout=self.config.call_timeout)
        )
        return response.token

    async def regenerate(
        self, task_id: str, *, seed: int | None = None, idempotency_key: str | None = None
    ) -> AsyncTaskHandle:
        """A new task from a finished one's request: a new seed (random unless given), at HIGH when the tenant may use
        it.

        Without `idempotency_key` a fresh one is generated once per call, so the built-in retries make one task only.
        """
        request = gateway_pb2.RegenerateTaskRequest(
            task_id=task_id, idempotency_key=idempotency_key or str(uuid.uuid4())
        )
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
        request = gateway_pb2.TaskGatewayRotateWebhookSecretRequest(overlap=duration(overlap))
        try:
            return await self._gateway.RotateWebhookSecret(
                request, metadata=self.metadata, timeout=self.config.call_timeout
            )
        except grpc.aio.AioRpcError as exc:
            raise from_rpc_error(exc) from None

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

    async def download(self, task_id: str, path: str | os.PathLike[str]) -> TaskResult:
        """Saves a SUCCEEDED task's output into `path` (from its result URL when it has one, else streamed over gRPC)
        and checks its size and sha256 (IntegrityError if not)."""
        target = Path(path)
        task, _ = await self.get_with_interval(task_id)
        if task.result is not None and task.result.url.startswith(("https://", "http://")):
            try:
                return await asyncio.to_thread(fetch_url, task.result, target, self.config.call_timeout)
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
            check_integrity(info, size, digest)
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


def connect_async(
    address: str | None = None, api_key: str | None = None, **options: Unpack[ConnectOptions]
) -> AsyncTaskgateClient:
    """An asyncio client. Events default to port 50052 and admin to 50053 on the gateway's host.

    Certificates may be PEM bytes or file paths; giving any of them turns TLS on.
    """
    return AsyncTaskgateClient(
        make_config(address, api_key, **options)
    )


# Imported from here by the blocking client and users: the client's names stay where they were before the split.
__all__ = [
    "INLINE_IMAGE_BYTES",
    "MAX_SUBMIT_BATCH",
    "AsyncEventStream",
    "AsyncTaskgateClient",
    "StatusFilter",
    "chat_request",
    "connect_async",
    "submit_request",
]
