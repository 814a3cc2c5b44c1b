"""The blocking client: the asyncio client driven from a private event-loop thread, so both behave the same."""

from __future__ import annotations

import asyncio
import builtins
import os
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Generator, Iterable
from concurrent.futures import Future
from types import TracebackType
from typing import Any, TypeVar

from typing_extensions import Unpack

from taskgate.v1 import admin_pb2
from taskgate_client.aio import AsyncTaskgateClient, StatusFilter
from taskgate_client.config import ClientConfig, ConnectOptions, make_config
from taskgate_client.types import Task, TaskEvent, TaskResult

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


class TaskgateClient:
    """A blocking client with the same methods as AsyncTaskgateClient; use it as a context manager or close() it."""

    def __init__(self, config: ClientConfig) -> None:
        self._runner = _LoopThread()
        self._client = AsyncTaskgateClient(config)
        self.config = self._client.config

    def __enter__(self) -> TaskgateClient:
        return self

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None) -> None:
        self.close()

    def close(self) -> None:
        """Closes the channels and stops the loop thread."""
        try:
            self._runner.run(self._client.close())
        finally:
            self._runner.stop()

    def submit(self, prompt: str, model: str | None = None, **kwargs: Any) -> Task:
        """Submits a task; see AsyncTaskgateClient.submit for the parameters."""
        return self._runner.run(self._client.submit(prompt, model, **kwargs))

    def get(self, task_id: str) -> Task:
        """The task's current state."""
        return self._runner.run(self._client.get(task_id))

    def list(self, status: StatusFilter = None, *, page_size: int = 100) -> Generator[Task, None, None]:
        """The caller's tasks, newest first, fetching pages as the iteration goes."""
        return self._runner.iterate(self._client.list(status, page_size=page_size))

    def cancel(self, task_id: str, hard: bool = False) -> Task:
        """Cancels a task (soft by default; hard stops inference at the next step)."""
        return self._runner.run(self._client.cancel(task_id, hard))

    def watch(self, task_id: str, *, after_version: int = 0) -> Generator[TaskEvent, None, None]:
        """The snapshot, then each event until the task is terminal; resumes dropped streams."""
        return self._runner.iterate(self._client.watch(task_id, after_version=after_version))

    def wait(self, task_id: str, timeout: float | None = None, *, on_event: Callable[[TaskEvent], Any] | None = None) -> Task:
        """Blocks until the task is terminal (WaitTimeout after `timeout` seconds)."""
        return self._runner.run(self._client.wait(task_id, timeout, on_event=on_event))

    def download(self, task_id: str, path: str | os.PathLike[str]) -> TaskResult:
        """Writes the task's output to `path`, verified against its sha256."""
        return self._runner.run(self._client.download(task_id, path))

    def stats(self) -> admin_pb2.GetStatsResponse:
        """Admin: counts per model and state, workers, callbacks."""
        return self._runner.run(self._client.stats())

    def stuck(self, limit: int = 100) -> builtins.list[admin_pb2.StuckTask]:
        """Admin: tasks the scheduler considers stuck."""
        return self._runner.run(self._client.stuck(limit))

    def requeue(self, task_ids: Iterable[str] = (), **kwargs: Any) -> Generator[admin_pb2.RequeueBatch, None, None]:
        """Admin: requeues in batches, yielding each batch's report."""
        return self._runner.iterate(self._client.requeue(task_ids, **kwargs))

    def dead_letters(self, *, page_size: int = 100) -> Generator[admin_pb2.DeadLetter, None, None]:
        """Admin: tasks that failed for good."""
        return self._runner.iterate(self._client.dead_letters(page_size=page_size))

    def redeliver(self, task_id: str) -> builtins.list[admin_pb2.CallbackDelivery]:
        """Admin: sends a task's callbacks again."""
        return self._runner.run(self._client.redeliver(task_id))


def connect(
    address: str | None = None, api_key: str | None = None, **options: Unpack[ConnectOptions]
) -> TaskgateClient:
    """A blocking client. Events default to port 50052 and admin to 50053 on the gateway's host.

    Certificates may be PEM bytes or file paths; giving any of them turns TLS on.
    """
    return TaskgateClient(
        make_config(address, api_key, **options)
    )
