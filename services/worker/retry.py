"""The retry policy: which failures get another attempt and after how long, and how final writes ride out outages."""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

from services.worker import runner as runmod
from taskgate import store
from taskgate.config import WorkerSettings
from taskgate.model import TaskRow
from taskgate.server import BACKEND_ERRORS

log = logging.getLogger("taskgate.worker")

T = TypeVar("T")
ERROR_MSG_CHARS = 500


class RunError(Exception):
    """A failed attempt as its task will record it: a stable code and a human message."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message

    @property
    def error(self) -> store.TaskError:
        """What the task row records."""
        return store.TaskError(self.code, self.message)


class RetryableError(RunError):
    """A failure worth another attempt: retry number `retry` (1 for the first), claimable after `delay` seconds."""

    def __init__(self, code: str, message: str, *, delay: float, retry: int) -> None:
        super().__init__(code, message)
        self.delay = delay
        self.retry = retry


class PermanentError(RunError):
    """A failure that ends the task: at once, or dead-lettered when a retryable one has used up its retries."""

    def __init__(self, code: str, message: str, *, dead_letter: bool) -> None:
        super().__init__(code, message)
        self.dead_letter = dead_letter

    @property
    def reason(self) -> str:
        """Why the task fails, as its history and dead letter say."""
        return "retries exhausted" if self.dead_letter else "permanent failure"


def backoff(settings: WorkerSettings, retry_count: int) -> float:
    """Delay before retry number retry_count + 1: doubling from retry_backoff_seconds, jittered, capped."""
    base = settings.retry_backoff_seconds * 2**retry_count
    jitter = random.uniform(1 - settings.retry_jitter, 1 + settings.retry_jitter)
    return min(settings.retry_backoff_max_seconds, base * jitter)


def failure_of(exc: BaseException, *, task: TaskRow, settings: WorkerSettings) -> RetryableError | PermanentError:
    """What a run's failure means for its task: retried after a backoff while retries remain, else failed."""
    retryable, code = runmod.classify(exc)
    message = f"{type(exc).__name__}: {exc}"[:ERROR_MSG_CHARS]
    if retryable and task.retry_count < task.max_retries:
        return RetryableError(code, message, delay=backoff(settings, task.retry_count), retry=task.retry_count + 1)
    return PermanentError(code, message, dead_letter=retryable)


async def persist(within: float, what: str, task_id: int, action: Callable[[], Awaitable[T]]) -> T:
    """Retries a final write through a backend outage of up to `within` seconds (the heartbeat keeps the lease)."""
    deadline = time.monotonic() + within
    delay = 0.05
    while True:
        try:
            return await action()
        except BACKEND_ERRORS as exc:
            if time.monotonic() + delay > deadline:
                raise
            log.warning(
                "final write failed; retrying",
                extra={"task_id": str(task_id), "what": what, "error": type(exc).__name__},
            )
            await asyncio.sleep(delay)
            delay = min(2 * delay, 1.0)
