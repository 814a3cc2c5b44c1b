"""Each service holding only what it needs: a real nats-server with one user per service (taskgate.natsauth) and a
PostgreSQL role per service (sql/functions/grants.sql). The whole flow runs on those alone — submit, dispatch, run,
store, relay, stream, download — and each is refused what its service never does."""

from __future__ import annotations

import asyncio
import contextlib
import secrets
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import asyncpg
import grpc
import nats
import pytest
from nats.aio.client import Client as NATS
from nats.errors import Error as NatsError

from services.notifier.service import start as start_notifier
from services.scheduler.service import start as start_scheduler
from services.submit.service import start as start_submit
from services.worker.service import start as start_worker
from taskgate import auth, bus, migrate, natsauth, output
from taskgate.config import ModelSpec, Settings
from taskgate.states import Priority, Status
from taskgate_api.v1 import events_pb2, events_pb2_grpc, gateway_pb2, gateway_pb2_grpc, task_pb2
from taskgate_local.embedded import EmbeddedNats
from tests.support.harness import ROOT, wait_for

MODEL = "sleepy"
SERVICES = ("submit", "scheduler", "worker", "notifier")


def as_login(database_url: str, service: str) -> str:
    """The database URL of `service`'s login role (the test server trusts local connections)."""
    parts = urlsplit(database_url)
    return urlunsplit(parts._replace(netloc=f"tg_{service}@{parts.netloc.rsplit('@', 1)[-1]}"))


async def service_roles(database_url: str) -> None:
    """What an operator does once: a NOLOGIN group role per service and a login role in it; then the migrate step
    (as the owner) grants each group what it may touch."""
    conn = await asyncpg.connect(database_url)
    try:
        for service in SERVICES:
            for role, options in (
                (f"taskgate_{service}", "NOLOGIN"),
                (f"tg_{service}", f"LOGIN IN ROLE taskgate_{service}"),
            ):
                if not await conn.fetchval("SELECT 1 FROM pg_roles WHERE rolname = $1", role):
                    await conn.execute(f"CREATE ROLE {role} {options}")
        await migrate.migrate(conn)
    finally:
        await conn.close()


class Users:
    """A nats-server started with natsauth's authorization block, and each role's URL."""

    def __init__(self, server: EmbeddedNats, passwords: dict[str, str]) -> None:
        self.server = server
        self.passwords = passwords

    def url(self, role: str) -> str:
        return f"nats://{role}:{self.passwords[role]}@127.0.0.1:{self.server.port}"

    async def client(self, role: str, refusals: list[str]) -> NATS:
        """A raw client of `role` that notes every error the server sends it (a refusal does not close it)."""

        async def noted(exc: Exception) -> None:
            refusals.append(str(exc))

        return await nats.connect(self.url(role), error_cb=noted, allow_reconnect=False, connect_timeout=5)


@pytest.fixture
async def users(tmp_path: Path) -> AsyncIterator[Users]:
    passwords = {role: secrets.token_urlsafe(12) for role in natsauth.ROLES}
    conf = tmp_path / "nats.conf"
    conf.write_text(natsauth.authorization(passwords))
    server = EmbeddedNats(tmp_path / "nats", args=("-c", str(conf))).start()
    try:
        yield Users(server, passwords)
    finally:
        server.stop()


def as_role(settings: Settings, users: Users, role: str, **update: Any) -> Settings:
    """The settings a service runs with: its own NATS user and database role, and no migrate or declare of its own."""
    models = {**settings.models, MODEL: ModelSpec(kind="sleep", sleep_seconds=0.0)}
    assert settings.database_url is not None
    database_url = settings.database_url if role == "admin" else as_login(settings.database_url, role)
    return settings.model_copy(
        update={"nats_url": users.url(role), "database_url": database_url, "setup_on_start": False, "models": models,
                **update}
    )


async def refused(refusals: list[str], action: Callable[[], Awaitable[object]]) -> str:
    """Runs `action`, which the server must refuse; returns the refusal it sent."""
    before = len(refusals)
    with contextlib.suppress(NatsError, TimeoutError):  # a request whose subject is refused gets no answer
        await action()
    await wait_for(lambda: len(refusals) > before, within=5.0)
    return refusals[-1].lower()


async def test_every_service_runs_on_its_own_nats_user_and_database_role_and_is_refused_the_rest(
    settings: Settings, database_url: str, users: Users
) -> None:
    await service_roles(database_url)
    await migrate.declare_streams(as_role(settings, users, "admin"), users.url("admin"))  # the migrate step's part
    admin = await bus.connect(users.url("admin"), "operator")
    pool = await asyncpg.create_pool(database_url, min_size=1, max_size=2)
    key, _ = await auth.create_key(pool, settings.api_key_pepper, "tenant-a", submits_per_minute=100, max_pending=10)
    metadata = (("authorization", f"Bearer {key}"),)
    handles: list[Any] = []
    try:
        handles.append(await start_scheduler(as_role(settings, users, "scheduler")))
        notifier = await start_notifier(as_role(settings, users, "notifier"))
        handles.append(notifier)
        worker_settings = as_role(settings, users, "worker", worker_models=[MODEL], worker_slots=1)
        handles.append(await start_worker(worker_settings))
        submit = await start_submit(as_role(settings, users, "submit"))
        handles.append(submit)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{submit.port}") as gw, \
                grpc.aio.insecure_channel(f"127.0.0.1:{notifier.port}") as ev:
            gateway = gateway_pb2_grpc.TaskGatewayStub(gw)
            watch = events_pb2_grpc.TaskEventsStub(ev).WatchTasks(events_pb2.WatchTasksRequest(), metadata=metadata)
            assert (await watch.read()).HasField("keepalive")  # live
            answer = await gateway.SubmitTask(
                gateway_pb2.SubmitTaskRequest(prompt="a fox", model_id=MODEL), metadata=metadata
            )
            task_id = answer.task.id

            async def finished() -> bool:
                got = await gateway.GetTask(gateway_pb2.GetTaskRequest(task_id=task_id), metadata=metadata)
                return bool(got.task.status == task_pb2.TASK_STATUS_SUCCEEDED)

            await wait_for(finished, within=30.0)
            seen: list[int] = []
            while not seen or seen[-1] != task_pb2.TASK_STATUS_SUCCEEDED:  # relayed and streamed on notifier's user
                message = await asyncio.wait_for(watch.read(), 10.0)
                if message.HasField("event"):
                    seen.append(message.event.to_status)
            chunks = [c async for c in gateway.GetTaskResult(gateway_pb2.GetTaskResultRequest(task_id=task_id),
                                                              metadata=metadata)]
            assert sum(len(c.data) for c in chunks) > 0  # the worker stored it, submit read it back

            # partial output: the worker's user stores a chunk, the notifier's user reads and follows it
            worker_bus = await bus.connect(users.url("worker"), "worker-output")
            try:
                chunk = output.Chunk(task_id=int(task_id), attempt=1, kind=output.TEXT, text="partial")
                await output.publish(worker_bus, "tenant-a", chunk)
            finally:
                await worker_bus.close()
            follow = events_pb2_grpc.TaskEventsStub(ev).WatchTask(
                events_pb2.WatchTaskRequest(task_id=task_id, include_output=True), metadata=metadata
            )
            streamed = [m async for m in follow]
            assert [m.output.text for m in streamed if m.HasField("output")] == ["partial"]

            # a forged event (as if another tenant's subject had been taken) is not routed by its payload
            forged = task_pb2.TaskEvent(
                task_id="1", user_id="tenant-a", version=1, to_status=Status.SUCCEEDED.to_proto()
            )
            await admin.js.publish(bus.event_subject("tenant-b", 1), forged.SerializeToString())
            again = await gateway.SubmitTask(
                gateway_pb2.SubmitTaskRequest(prompt="a second fox", model_id=MODEL), metadata=metadata
            )
            message = await asyncio.wait_for(watch.read(), 10.0)
            while not message.HasField("event"):
                message = await asyncio.wait_for(watch.read(), 10.0)
            assert message.event.task_id == again.task.id
            watch.cancel()
    finally:
        for handle in reversed(handles):
            await handle.stop()
        await pool.close()

    log = (users.server.store_dir / "nats.log").read_text()
    assert "Violation" not in log  # the flow needed nothing its users are not allowed

    refusals: list[str] = []
    worker = await users.client("worker", refusals)
    notifier_user = await users.client("notifier", refusals)
    submit_user = await users.client("submit", refusals)
    try:
        events_before = (await admin.js.stream_info(bus.EVENTS_STREAM)).state.messages
        fake = forged.SerializeToString()
        said = await refused(
            refusals, lambda: worker.jetstream().publish(bus.event_subject("tenant-a", 1), fake, timeout=1)
        )
        assert "permissions violation for publish" in said and "taskgate.events" in said
        said = await refused(refusals, lambda: worker.jetstream(timeout=1).purge_stream(bus.TASKS_STREAM))
        assert "$js.api.stream.purge.tasks" in said
        said = await refused(refusals, lambda: worker.subscribe(bus.EVENT_SUBJECTS))
        assert "permissions violation for subscription" in said
        said = await refused(refusals, lambda: worker.subscribe(bus.OUTPUT_LIVE_SUBJECTS))
        assert "permissions violation for subscription" in said
        said = await refused(refusals, lambda: worker.publish(bus.output_live_subject("tenant-a", 1), b"forged"))
        assert "taskgate.live.output" in said  # only the stream republishes there
        said = await refused(refusals, lambda: notifier_user.publish(bus.task_subject(MODEL, Priority.NORMAL), b"x"))
        assert "taskgate.tasks" in said
        said = await refused(
            refusals,
            lambda: submit_user.request(
                f"$JS.API.CONSUMER.MSG.NEXT.TASKS.{bus.consumer_name(MODEL, Priority.NORMAL)}", b"1", timeout=1
            ),
        )
        assert "consumer.msg.next" in said
        assert (await admin.js.stream_info(bus.EVENTS_STREAM)).state.messages == events_before
    finally:
        for client in (worker, notifier_user, submit_user):
            await client.close()
        await admin.close()

    worker_db = await asyncpg.connect(as_login(database_url, "worker"))
    try:
        assert await worker_db.fetchval("SELECT count(*) FROM task") == 2  # its own work it reads
        for table in ("api_key", "webhook_secret"):
            with pytest.raises(asyncpg.InsufficientPrivilegeError):
                await worker_db.fetch(f"SELECT * FROM {table}")
        with pytest.raises(asyncpg.InsufficientPrivilegeError):
            await worker_db.execute("CREATE TABLE mine (x int)")
        with pytest.raises(asyncpg.InsufficientPrivilegeError):
            await worker_db.execute("DELETE FROM schema_migration")
    finally:
        await worker_db.close()
    submit_db = await asyncpg.connect(as_login(database_url, "submit"))
    try:
        with pytest.raises(asyncpg.InsufficientPrivilegeError):
            await submit_db.execute("ALTER TABLE task ADD COLUMN mine int")
    finally:
        await submit_db.close()


def test_the_shipped_authorization_block_is_the_one_the_roles_make() -> None:
    """deploy/nats/authorization.conf is `python -m taskgate.natsauth` (passwords from the server's environment)."""
    shipped = (ROOT / "deploy" / "nats" / "authorization.conf").read_text()
    assert shipped == natsauth.authorization(), (
        "regenerate: python -m taskgate.natsauth > deploy/nats/authorization.conf"
    )
    assert all(f"${natsauth.password_variable(role)}" in shipped for role in natsauth.ROLES)
