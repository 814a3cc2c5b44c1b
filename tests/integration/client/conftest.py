"""The client tests' stack: the services in this process, and an SDK client of them."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from services.notifier import service as notifier_service
from services.scheduler import service as scheduler_service
from services.submit import service as submit_service
from taskgate import auth
from taskgate.config import Settings
from taskgate.runtime import Backends
from taskgate_client import (
    AsyncTaskgateClient,
)
from taskgate_local.embedded import free_port
from tests.support.stacks import Stack


@pytest.fixture
async def stack(settings: Settings, backends: Backends) -> AsyncIterator[Stack]:
    settings = settings.model_copy(update={"notifier_port": free_port(), "stream_keepalive_seconds": 1.0})
    submit = await submit_service.start(settings, backends)
    scheduler = await scheduler_service.start(settings, backends, scan_loop=False)
    notifier = await notifier_service.start(settings)
    api_key, _ = await auth.create_key(
        backends.pool, settings.api_key_pepper, "tenant-a", max_pending=50, submits_per_minute=1000
    )
    admin_key, _ = await auth.create_key(backends.pool, settings.api_key_pepper, "ops", admin=True)
    s = Stack(settings, backends, submit, scheduler, notifier, api_key, admin_key)
    try:
        yield s
    finally:
        await s.notifier.stop()
        await scheduler.stop(0)
        await submit.stop(0)


@pytest.fixture
async def client(stack: Stack) -> AsyncIterator[AsyncTaskgateClient]:
    async with stack.client() as c:
        yield c
