"""The blocking client: the asyncio client driven from a private event-loop thread, so both behave the same."""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import os
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Generator, Iterable
from concurrent.futures import Future
from datetime import datetime
from types import TracebackType
from typing import TYPE_CHECKING, Any, TypeVar

from taskgate_api.v1 import admin_pb2, gateway_pb2
from taskgate_client.aio import MAX_SUBMIT_BATCH, AsyncEventStream, AsyncTaskgateClient, StatusFilter
from taskgate_client.config import ClientConfig, ConnectOptions, make_config
from taskgate_client.errors import TaskgateError
from taskgate_client.handles import TaskHandle
from taskgate_client.streaming import Output, Preview, TextDelta
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

T = TypeVar("T")


async def _awaited(awaitable: Awaitable[T]) -> T:
    return await awaitable


class _LoopThread:
    """One event loop on a daemon thread; runs coroutines for the calling thread."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="taskgate-client", daemon=True)
        self._thread.start()

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        future: Future[T] = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return future.result()
        except BaseException:
            # Ctrl-C in the caller: do not leave the call running on the loop thread.
            future.cancel()
            raise

    def iterate(self, agen: AsyncIterator[T]) -> Generator[T, None, None]:
        try:
            while True:
                try:
                    yield self.run(_awaited(agen.__anext__()))
                except StopAsyncIteration:
                    return
        finally:
            aclose = getattr(agen, "aclose", None)
            if aclose is not None and self.loop.is_running():
                self.run(aclose())

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(5)
        if not self._thread.is_alive():
            self.loop.close()


class EventStream:
    """WatchTasks as an iterator of TaskEvent; `cursor` is where a later `watch_all(cursor=...)` resumes."""

    def __init__(self, runner: _LoopThread, stream: AsyncEventStream) -> None:
        self._stream = stream
        self._events = runner.iterate(stream)

    def __iter__(self) -> EventStream:
        return self

    def __next__(self) -> TaskEvent:
        return next(self._events)

    @property
    def cursor(self) -> str:
        """Resume after the last event yielded (save it after handling each event)."""
        return self._stream.cursor

    def close(self) -> None:
        """Ends the stream."""
        self._events.close()


class TaskgateClient:
    """A blocking client with the same methods as AsyncTaskgateClient; use it as a context manager or close() it."""

    def __init__(self, config: ClientConfig) -> None:
        self._runner = _LoopThread()
        self._client = self._async_client(config)
        self.config = self._client.config

    def _async_client(self, config: ClientConfig) -> AsyncTaskgateClient:
        """The asyncio client this one drives (the testing fake substitutes its own)."""
        return AsyncTaskgateClient(config)

    def _handle(self, task: Task) -> TaskHandle:
        return TaskHandle.bind(task, self)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None) -> None:
        self.close()

    def close(self) -> None:
        """Closes the channels and stops the loop thread."""
        try:
            self._runner.run(self._client.close())
        finally:
            self._runner.stop()

    def submit(self, prompt: str, model: str | None = None, **options: Unpack[SubmitOptions]) -> TaskHandle:
        """Submits a task and returns its handle; see AsyncTaskgateClient.submit for the parameters."""
        return self._handle(self._runner.run(self._client.submit(prompt, model, **options)))

    def chat(self, messages: ChatInput, model: str | None = None, **options: Unpack[ChatOptions]) -> TaskHandle:
        """Submits a chat task and returns its handle; see AsyncTaskgateClient.chat for the parameters."""
        return self._handle(self._runner.run(self._client.chat(messages, model, **options)))

    def upload_input(self, image: ImageSource) -> InputImage:
        """Stores an input image for later submissions; see AsyncTaskgateClient.upload_input."""
        return self._runner.run(self._client.upload_input(image))

    def upload_text(self, text: str | bytes | os.PathLike[str]) -> InputText:
        """Stores a chat text attachment; see AsyncTaskgateClient.upload_text."""
        return self._runner.run(self._client.upload_text(text))

    def submit_many(
        self,
        items: Iterable[SubmitItem],
        *,
        chunk_size: int = MAX_SUBMIT_BATCH,
        on_progress: Callable[[int, int], Any] | None = None,
    ) -> builtins.list[TaskHandle | TaskgateError]:
        """Submits many tasks, one result per item (its handle or its own error); see
        AsyncTaskgateClient.submit_many."""
        results = self._runner.run(self._client.submit_many(items, chunk_size=chunk_size, on_progress=on_progress))
        return [r if isinstance(r, TaskgateError) else self._handle(r) for r in results]

    def run(
        self,
        prompt: str,
        model: str | None = None,
        *,
        output: str | os.PathLike[str],
        timeout: float | None = None,
        on_event: Callable[[TaskEvent], Any] | None = None,
        **options: Unpack[SubmitOptions],
    ) -> TaskHandle:
        """Submits, follows the task until it ends and writes its output to `output`; returns the finished task.

        Raises TaskFailed when it ended without a result, WaitTimeout after `timeout` seconds (the task goes on).
        """
        task = self.submit(prompt, model, **options)
        done = task.wait(timeout, on_event=on_event)
        done.download(output)
        return done

    def get(self, task_id: str) -> TaskHandle:
        """The task's current state."""
        return self._handle(self._runner.run(self._client.get(task_id)))

    def list(self, status: StatusFilter = None, *, page_size: int = 100) -> Generator[TaskHandle, None, None]:
        """The caller's tasks, newest first, fetching pages as the iteration goes."""
        tasks = self._runner.iterate(self._client.list(status, page_size=page_size))
        with contextlib.closing(tasks):  # leaving the loop early closes the page stream at once
            for task in tasks:
                yield self._handle(task)

    def cancel(self, task_id: str, hard: bool = False) -> TaskHandle:
        """Cancels a task (soft by default; hard stops inference at the next step)."""
        return self._handle(self._runner.run(self._client.cancel(task_id, hard)))

    def client_token_secret(self, *, rotate: bool = False, overlap: float = 3600.0) -> str:
        """Your tenant's client-token secret for `mint_client_token`; `rotate`: a new one (the old one's tokens stay
        valid for `overlap` seconds)."""
        return self._runner.run(self._client.client_token_secret(rotate=rotate, overlap=overlap))

    def create_client_token(
        self, end_user: str, *, scopes: Iterable[str] = ("read", "watch"), task_ids: Iterable[str] = (),
        ttl_seconds: float = 900.0,
    ) -> str:
        """A short-lived token for one end user's tasks, minted by the gateway (CreateClientToken)."""
        return self._runner.run(
            self._client.create_client_token(end_user, scopes=scopes, task_ids=task_ids, ttl_seconds=ttl_seconds)
        )

    def regenerate(self, task_id: str, *, seed: int | None = None, idempotency_key: str | None = None) -> TaskHandle:
        """A new task from a finished one's request: a new seed (random unless given), at HIGH when the tenant may use
        it."""
        return self._handle(
            self._runner.run(self._client.regenerate(task_id, seed=seed, idempotency_key=idempotency_key))
        )

    def watch(
        self, task_id: str, *, after_version: int = 0, resume_attempts: int | None = None
    ) -> Generator[TaskEvent, None, None]:
        """The snapshot, then each event until the task is terminal; resumes dropped streams."""
        return self._runner.iterate(
            self._client.watch(task_id, after_version=after_version, resume_attempts=resume_attempts)
        )

    def output(
        self, task_id: str, *, after_sequence: int = 0, resume_attempts: int | None = None
    ) -> Generator[Output, None, None]:
        """See AsyncTaskgateClient.output."""
        return self._runner.iterate(
            self._client.output(task_id, after_sequence=after_sequence, resume_attempts=resume_attempts)
        )

    def stream_text(self, task_id: str, *, resume_attempts: int | None = None) -> Generator[TextDelta, None, None]:
        """See AsyncTaskgateClient.stream_text."""
        return self._runner.iterate(self._client.stream_text(task_id, resume_attempts=resume_attempts))

    def previews(
        self, task_id: str, *, fetch: bool = True, after_sequence: int = 0, resume_attempts: int | None = None
    ) -> Generator[Preview, None, None]:
        """See AsyncTaskgateClient.previews."""
        return self._runner.iterate(
            self._client.previews(task_id, fetch=fetch, after_sequence=after_sequence, resume_attempts=resume_attempts)
        )

    def preview_bytes(self, task_id: str, uri: str) -> bytes:
        """See AsyncTaskgateClient.preview_bytes."""
        return self._runner.run(self._client.preview_bytes(task_id, uri))

    def logs(
        self, task_id: str, *, after_sequence: int = 0, resume_attempts: int | None = None
    ) -> Generator[Output, None, None]:
        """See AsyncTaskgateClient.logs."""
        return self._runner.iterate(
            self._client.logs(task_id, after_sequence=after_sequence, resume_attempts=resume_attempts)
        )

    def text(self, task_id: str, timeout: float | None = None) -> str:
        """See AsyncTaskgateClient.text."""
        return self._runner.run(self._client.text(task_id, timeout))

    def watch_all(
        self, status: StatusFilter = None, *, cursor: str | None = None, resume_attempts: int | None = None
    ) -> EventStream:
        """Every event of the caller's tasks from `cursor` on (None: from now); resumes dropped streams. Never ends."""
        return EventStream(self._runner, self._client.watch_all(status, cursor=cursor, resume_attempts=resume_attempts))

    def wait(
        self, task_id: str, timeout: float | None = None, *, on_event: Callable[[TaskEvent], Any] | None = None
    ) -> TaskHandle:
        """Blocks until the task is terminal (WaitTimeout after `timeout` seconds)."""
        return self._handle(self._runner.run(self._client.wait(task_id, timeout, on_event=on_event)))

    def download(self, task_id: str, path: str | os.PathLike[str]) -> TaskResult:
        """Writes the task's output to `path`, verified against its sha256."""
        return self._runner.run(self._client.download(task_id, path))

    def stats(self) -> admin_pb2.GetStatsResponse:
        """Admin: counts per model and state, workers, callbacks."""
        return self._runner.run(self._client.stats())

    def stuck(self, limit: int = 100) -> builtins.list[admin_pb2.StuckTask]:
        """Admin: tasks the scheduler considers stuck."""
        return self._runner.run(self._client.stuck(limit))

    def requeue(
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
    ) -> Generator[admin_pb2.RequeueBatch, None, None]:
        """Admin: requeues in batches, yielding each batch's report; `replay_finished` replays FAILED and TIMEOUT tasks
        as new tasks (see the asyncio client's `requeue`)."""
        return self._runner.iterate(
            self._client.requeue(
                task_ids, status=status, model=model, older_than=older_than, dry_run=dry_run, batch_size=batch_size,
                reason=reason, replay_finished=replay_finished,
            )
        )

    def dead_letters(self, *, page_size: int = 100) -> Generator[admin_pb2.DeadLetter, None, None]:
        """Admin: tasks that failed for good."""
        return self._runner.iterate(self._client.dead_letters(page_size=page_size))

    def redeliver(self, task_id: str) -> builtins.list[admin_pb2.CallbackDelivery]:
        """Admin: sends a task's callbacks again."""
        return self._runner.run(self._client.redeliver(task_id))

    def deliveries(
        self, status: str | None = None, *, page_size: int = 100
    ) -> Generator[admin_pb2.DeliveryRecord, None, None]:
        """Admin: webhook deliveries in a state, newest first, with attempts and last error."""
        return self._runner.iterate(self._client.deliveries(status, page_size=page_size))

    def audit(self, admin: str | None = None, *, page_size: int = 100) -> Generator[admin_pb2.AuditEvent, None, None]:
        """Admin: what admins did, newest first."""
        return self._runner.iterate(self._client.audit(admin, page_size=page_size))

    def rotate_own_webhook_secret(
        self, *, overlap: float = 24 * 3600.0
    ) -> gateway_pb2.TaskGatewayRotateWebhookSecretResponse:
        """A new webhook secret for your own tenant (shown once); the current ones keep signing for `overlap`
        seconds."""
        return self._runner.run(self._client.rotate_own_webhook_secret(overlap=overlap))

    def rotate_webhook_secret(
        self, tenant: str, *, overlap: float = 24 * 3600.0
    ) -> admin_pb2.RotateWebhookSecretResponse:
        """Admin: a new webhook secret for a tenant; its current ones keep signing for `overlap` seconds."""
        return self._runner.run(self._client.rotate_webhook_secret(tenant, overlap=overlap))

    def api_keys(self, tenant: str | None = None) -> builtins.list[admin_pb2.ApiKeyInfo]:
        """Admin: every API key (of one tenant when given) by prefix."""
        return self._runner.run(self._client.api_keys(tenant))

    def revoke_api_keys(self, prefix: str) -> int:
        """Admin: revokes the live keys with a prefix; how many."""
        return self._runner.run(self._client.revoke_api_keys(prefix))

    def usage(
        self, tenant: str | None = None, *, since: datetime | None = None, until: datetime | None = None,
        by_hour: bool = False, by_end_user: bool = False, end_user: str | None = None,
    ) -> admin_pb2.GetUsageResponse:
        """Admin: metered GPU-seconds and slot seconds per tenant and model (per UTC hour with `by_hour`, per end user
        with `by_end_user`; `end_user`: only that one's)."""
        return self._runner.run(self._client.usage(
            tenant, since=since, until=until, by_hour=by_hour, by_end_user=by_end_user, end_user=end_user
        ))

    def purge(self, older_than: float, *, dry_run: bool = False) -> admin_pb2.PurgeTasksResponse:
        """Admin: deletes finished tasks and reusable outputs older than `older_than` seconds (dry_run: counts only)."""
        return self._runner.run(self._client.purge(older_than, dry_run=dry_run))


def connect(
    address: str | None = None, api_key: str | None = None, **options: Unpack[ConnectOptions]
) -> TaskgateClient:
    """A blocking client. Events default to port 50052 and admin to 50053 on the gateway's host.

    Certificates may be PEM bytes or file paths; giving any of them turns TLS on.
    """
    return TaskgateClient(
        make_config(address, api_key, **options)
    )
