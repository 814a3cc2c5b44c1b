"""Revocation in seconds: a revoked API key is announced by PostgreSQL (LISTEN/NOTIFY), so every service drops its
cached answer and ends the key's open streams at once, however long the key cache would have trusted it."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest

from services.notifier import service as notifier_service
from taskgate import auth
from taskgate.config import Settings
from taskgate.runtime import Backends
from taskgate.store import tenants
from taskgate_api.v1 import admin_pb2, events_pb2, events_pb2_grpc, gateway_pb2
from taskgate_local.embedded import free_port
from tests.support.factories import insert_task
from tests.support.harness import ApiStack, api_stack, bearer, wait_for


@pytest.fixture
async def stack(settings: Settings, backends: Backends) -> AsyncIterator[ApiStack]:
    # a key cache far longer than the test: only the notification can explain a refusal within seconds
    s = settings.model_copy(update={"api_key_cache_seconds": 600.0, "stream_keepalive_seconds": 0.2})
    async with api_stack(s, backends) as started:
        yield started


async def kept_alive(call: Any) -> bool:
    """Reads a stream (events first, if any) until a keep-alive shows it open and authenticated."""
    while not (await call.read()).HasField("keepalive"):
        pass
    return True


async def ended_with(call: Any) -> grpc.aio.AioRpcError:
    """Reads a stream until it fails; the failure."""
    while True:
        try:
            await call.read()
        except grpc.aio.AioRpcError as exc:
            return exc


async def test_a_revoked_key_loses_its_open_streams_and_every_cached_answer_within_seconds(
    stack: ApiStack, backends: Backends
) -> None:
    pepper = backends.settings.api_key_pepper
    key, _ = await auth.create_key(backends.pool, pepper, "tenant-a")
    kept, _ = await auth.create_key(backends.pool, pepper, "tenant-a")  # the tenant's other key stays good
    admin, _ = await auth.create_key(backends.pool, pepper, "ops", admin=True)
    task = await insert_task(backends.pool)
    get = gateway_pb2.GetTaskRequest(task_id=str(task.id))
    assert (await stack.gateway.GetTask(get, metadata=bearer(key))).task.id == str(task.id)  # cached now

    one = stack.events.WatchTask(events_pb2.WatchTaskRequest(task_id=str(task.id)), metadata=bearer(key))
    assert (await one.read()).HasField("snapshot")
    every = stack.events.WatchTasks(events_pb2.WatchTasksRequest(), metadata=bearer(key))
    other = stack.events.WatchTasks(events_pb2.WatchTasksRequest(), metadata=bearer(kept))
    for call in (every, other):
        assert await asyncio.wait_for(kept_alive(call), 5)

    revoked_at = time.monotonic()
    answer = await stack.admin.RevokeApiKeys(admin_pb2.RevokeApiKeysRequest(prefix=key[:10]), metadata=bearer(admin))
    assert answer.revoked == 1
    for call in (one, every):
        failure = await asyncio.wait_for(ended_with(call), 5)
        assert failure.code() is grpc.StatusCode.UNAUTHENTICATED and "revoked" in (failure.details() or ""), failure
    assert time.monotonic() - revoked_at < 5

    async def refused() -> bool:
        try:
            await stack.gateway.GetTask(get, metadata=bearer(key))
        except grpc.aio.AioRpcError as exc:
            return exc.code() is grpc.StatusCode.UNAUTHENTICATED
        return False

    await wait_for(refused, within=5)
    assert time.monotonic() - revoked_at < 5
    # nothing else is touched: the tenant's other key answers and its stream runs on
    assert (await stack.gateway.GetTask(get, metadata=bearer(kept))).task.id == str(task.id)
    assert await asyncio.wait_for(kept_alive(other), 5)
    other.cancel()


async def test_a_revocation_missed_while_listening_was_down_still_ends_the_stream(
    settings: Settings, backends: Backends
) -> None:
    s = settings.model_copy(update={"api_key_cache_seconds": 600.0, "stream_keepalive_seconds": 0.2})
    notifier = await notifier_service.start(s.model_copy(update={"notifier_port": free_port()}), backends)
    key, _ = await auth.create_key(backends.pool, backends.settings.api_key_pepper, "tenant-a")
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{notifier.port}") as channel:
            call = events_pb2_grpc.TaskEventsStub(channel).WatchTasks(
                events_pb2.WatchTasksRequest(), metadata=bearer(key)
            )
            assert await asyncio.wait_for(kept_alive(call), 5)
            notifier.listener.terminate()  # the revocation's NOTIFY goes to no one
            await wait_for(lambda: not notifier.listener.connected.is_set())
            assert len(await tenants.revoke_api_keys(backends.pool, key[:10])) == 1
            failure = await asyncio.wait_for(ended_with(call), 10)  # on reconnect every open stream's key is looked up
        assert failure.code() is grpc.StatusCode.UNAUTHENTICATED and "revoked" in (failure.details() or "")
    finally:
        await notifier.stop()
