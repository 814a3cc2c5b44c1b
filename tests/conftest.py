"""Real PostgreSQL and NATS for the whole session; each test gets its own database and clean streams."""

from __future__ import annotations

import asyncio
import itertools
import os
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import asyncpg
import grpc
import nats
import pytest

from services.submit.service import SubmitHandle
from services.submit.service import start as start_submit
from taskgate import bus as busmod
from taskgate.config import ModelSpec, Settings
from taskgate.embedded import EmbeddedStack
from taskgate.migrate import migrate
from taskgate.runtime import Backends, connect
from taskgate.v1 import gateway_pb2_grpc

TEMPLATE = "taskgate_template"
_counter = itertools.count()


def _with_database(url: str, name: str) -> str:
    parts = urlsplit(url)
    return urlunsplit((parts.scheme, parts.netloc, "/" + name, parts.query, parts.fragment))


@pytest.fixture(scope="session")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str]]:
    """Embedded servers for the session, or TASKGATE_TEST_DATABASE_URL / TASKGATE_TEST_NATS_URL when given."""
    db, nc = os.environ.get("TASKGATE_TEST_DATABASE_URL"), os.environ.get("TASKGATE_TEST_NATS_URL")
    if db and nc:
        yield db, nc
        return
    base = tmp_path_factory.mktemp("stack")
    base.chmod(0o755)
    stack = EmbeddedStack(base).start()
    assert stack.postgres is not None and stack.nats is not None
    try:
        yield stack.postgres.url, stack.nats.url
    finally:
        stack.stop()


@pytest.fixture(scope="session")
def template_url(servers: tuple[str, str]) -> str:
    """A migrated template database; test databases are cheap copies of it."""

    async def build() -> None:
        conn = await asyncpg.connect(servers[0])
        try:
            await conn.execute(f"DROP DATABASE IF EXISTS {TEMPLATE} WITH (FORCE)")
            await conn.execute(f"CREATE DATABASE {TEMPLATE}")
        finally:
            await conn.close()
        conn = await asyncpg.connect(_with_database(servers[0], TEMPLATE))
        try:
            await migrate(conn)
        finally:
            await conn.close()

    asyncio.run(build())
    return _with_database(servers[0], TEMPLATE)


@pytest.fixture
async def database_url(servers: tuple[str, str], template_url: str) -> AsyncIterator[str]:
    name = f"t_{os.getpid()}_{next(_counter)}"
    conn = await asyncpg.connect(servers[0])
    try:
        await conn.execute(f"CREATE DATABASE {name} TEMPLATE {TEMPLATE}")
    finally:
        await conn.close()
    yield _with_database(servers[0], name)
    conn = await asyncpg.connect(servers[0])
    try:
        await conn.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
    finally:
        await conn.close()


@pytest.fixture
async def nats_url(servers: tuple[str, str]) -> str:
    """The session's NATS with every taskgate stream and bucket removed, so each test starts empty."""
    nc = await nats.connect(servers[1])
    js = nc.jetstream()
    try:
        for name in await js.streams_info():
            assert name.config.name is not None
            await js.delete_stream(name.config.name)
    finally:
        await nc.close()
    return servers[1]


@pytest.fixture
def settings(database_url: str, nats_url: str, tmp_path: Path) -> Settings:
    """Settings for one test: its own database, clean streams, ephemeral ports, short timeouts."""
    return Settings(
        database_url=database_url,
        nats_url=nats_url,
        state_dir=tmp_path,
        submit_port=0,
        notifier_port=0,
        scheduler_port=0,
        worker_port=0,
        submit_metrics_port=0,
        notifier_metrics_port=0,
        scheduler_metrics_port=0,
        worker_metrics_port=0,
        callback_allow_hosts=["127.0.0.1"],
        models={"wan-tiny": ModelSpec(path=tmp_path / "models" / "wan-tiny"), "sleepy": ModelSpec(kind="sleep")},
    )


@pytest.fixture
async def backends(settings: Settings) -> AsyncIterator[Backends]:
    """Connected pool and bus, migrated and declared."""
    b = await connect(settings, "test")
    try:
        yield b
    finally:
        await b.close()



@pytest.fixture
async def gateway(settings: Settings, backends: Backends) -> AsyncIterator[SubmitHandle]:
    """A submit service on an ephemeral port over the test's backends."""
    handle = await start_submit(settings, backends)
    try:
        yield handle
    finally:
        await handle.stop(0)


@pytest.fixture
async def stub(gateway: SubmitHandle) -> AsyncIterator[gateway_pb2_grpc.TaskGatewayAsyncStub]:
    """A TaskGateway stub over a real channel to `gateway`."""
    async with grpc.aio.insecure_channel(f"127.0.0.1:{gateway.port}") as channel:
        yield gateway_pb2_grpc.TaskGatewayStub(channel)  # type: ignore[misc]


__all__ = ["busmod"]
