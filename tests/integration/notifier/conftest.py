"""The notifier tests' fixtures: a tenant's webhook secret and API key, notifiers started on demand."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable

import pytest

from services.notifier.relay import TestSignals
from services.notifier.service import NotifierHandle, start
from taskgate import auth
from taskgate.config import Settings
from taskgate.runtime import Backends
from tests.support.notifier import TENANT


@pytest.fixture
async def secret(backends: Backends, settings: Settings) -> str:
    """The tenant's webhook secret (its first one, made with its first API key)."""
    _key, made = await auth.create_key(backends.pool, settings.api_key_pepper, TENANT)
    assert made is not None
    return made


@pytest.fixture
async def notifier_factory(backends: Backends) -> AsyncIterator[Callable[..., Awaitable[NotifierHandle]]]:
    """Starts notifiers (sharing the test's backends unless own=True) and stops them at the end."""
    handles: list[NotifierHandle] = []

    async def make(settings: Settings, own: bool = False, signals: TestSignals | None = None) -> NotifierHandle:
        handle = await start(settings, None if own else backends, signals=signals)
        handles.append(handle)
        return handle

    yield make
    for handle in handles:
        await handle.stop()


@pytest.fixture
async def api_key(backends: Backends, settings: Settings) -> str:
    key, _secret = await auth.create_key(backends.pool, settings.api_key_pepper, TENANT)
    return key
