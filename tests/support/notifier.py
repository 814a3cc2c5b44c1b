"""Driving tasks through the moves the notifier relays, its settings for tests, and reading what it sends."""

from __future__ import annotations

import base64
import hashlib
import hmac
from collections.abc import AsyncIterator, Awaitable, Sequence
from contextlib import asynccontextmanager
from typing import Any

import grpc

from services.notifier.service import NotifierHandle
from taskgate import store
from taskgate.config import Settings
from taskgate.states import Status
from taskgate_api.v1 import events_pb2_grpc
from tests.support.factories import RESULT, claimed
from tests.support.harness import wait_for
from tests.support.webhooks import Received

TENANT = "tenant-a"


def fast(settings: Settings, **update: Any) -> Settings:
    """Short periods and a short retry schedule for tests."""
    base: dict[str, Any] = {
        "webhook_schedule_seconds": [0.0, 0.2, 0.4],
        "webhook_timeout_seconds": 2.0,
        "webhook_scan_interval_seconds": 0.2,
        "relay_scan_interval_seconds": 0.2,
        "webhook_jitter": 0.05,
    }
    return settings.model_copy(update={**base, **update})


async def run_to(pool: Any, task_id: int, status: Status, progress_steps: Sequence[int] = ()) -> None:
    """Drives a CREATED task through QUEUED and PROCESSING (with progress writes) to `status`."""
    assert (await store.queue(pool, task_id, actor="test")).applied
    if status is Status.QUEUED:
        return
    await claimed(pool, task_id, worker_id="w1", lease_seconds=30.0)
    await progress(pool, task_id, *progress_steps)
    ends: dict[Status, store.Change] = {
        Status.SUCCEEDED: store.Succeed(RESULT),
        Status.FAILED: store.Fail(store.TaskError("MODEL_ERROR", "the model fell over")),
        Status.TIMEOUT: store.TimeOut(store.TaskError("PROCESSING_TIMEOUT", "too slow")),
        Status.CANCELED: store.Cancel(store.CancelMode.SOFT),
    }
    if status in ends:
        assert (await store.apply(pool, task_id, ends[status], actor="test")).applied


def independent_signature(secret: str, request: Received) -> str:
    """The Standard Webhooks signature computed without taskgate's code."""
    key = base64.b64decode(secret.split("_", 1)[1])
    signed = f"{request.headers['webhook-id']}.{request.headers['webhook-timestamp']}.".encode() + request.body
    return "v1," + base64.b64encode(hmac.new(key, signed, hashlib.sha256).digest()).decode()


async def _eq(value: Awaitable[Any], expected: Any) -> bool:
    return (await value) == expected


async def all_relayed(pool: Any) -> None:
    """Waits until the relay has put every event on JetStream."""
    await wait_for(lambda: _eq(pool.fetchval("SELECT count(*) FROM event_outbox"), 0))


@asynccontextmanager
async def events_stub(handle: NotifierHandle, options: Sequence[tuple[str, Any]] = ()) -> AsyncIterator[Any]:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{handle.port}", options=list(options)) as channel:
        yield events_pb2_grpc.TaskEventsStub(channel)


async def progress(pool: Any, task_id: int, *steps: int) -> None:
    for step in steps:
        assert (
            await store.apply(pool, task_id, store.Progress(percent=step, lease_seconds=30.0), actor="test")
        ).applied


async def succeed(pool: Any, task_id: int) -> None:
    assert (await store.apply(pool, task_id, store.Succeed(RESULT), actor="test")).applied
