"""TaskAdmin over a real channel, for the scheduler's tests."""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc
import pytest

from services.scheduler import service
from taskgate import auth
from taskgate.runtime import Backends
from taskgate_api.v1 import admin_pb2_grpc
from tests.support.factories import all_settings
from tests.support.stacks import Admin


@pytest.fixture
async def admin(backends: Backends) -> AsyncIterator[Admin]:
    handle = await service.start(all_settings(backends), backends, scan_loop=False)
    pepper = backends.settings.api_key_pepper
    admin_key, _ = await auth.create_key(backends.pool, pepper, "ops", admin=True)
    user_key, _ = await auth.create_key(backends.pool, pepper, "tenant-a")
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{handle.port}")
    try:
        yield Admin(
            backends,
            admin_pb2_grpc.TaskAdminStub(channel),  # type: ignore[arg-type]
            (("authorization", f"Bearer {admin_key}"),),
            (("authorization", f"Bearer {user_key}"),),
        )
    finally:
        await channel.close()
        await handle.stop()
