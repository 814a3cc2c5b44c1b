"""Admin credentials are their own kind: a named key with a scope (read or operator) and an expiry, accepted by
TaskAdmin only (a tenant key is refused there, an admin key everywhere else), and every acting call is in an audit
log readable over TaskAdmin (ListAuditEvents, `taskgate admin audit`)."""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import AsyncIterator
from datetime import timedelta

import grpc
import pytest
from google.protobuf.duration_pb2 import Duration

from taskgate import auth
from taskgate.config import Settings
from taskgate.runtime import Backends
from taskgate_api.v1 import admin_pb2, events_pb2, gateway_pb2
from tests.support.harness import ApiStack, api_stack, bearer, wait_for


@pytest.fixture
async def stack(settings: Settings, backends: Backends) -> AsyncIterator[ApiStack]:
    async with api_stack(settings, backends) as started:
        yield started


async def refusal(call: object) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await call  # type: ignore[misc]
    return caught.value


async def test_an_admin_key_is_refused_outside_task_admin_and_a_tenant_key_inside_it(
    stack: ApiStack, backends: Backends
) -> None:
    pepper = backends.settings.api_key_pepper
    ops, _ = await auth.create_admin_key(backends.pool, pepper, "alice", scope=auth.OPERATOR)
    tenant, _ = await auth.create_key(backends.pool, pepper, "tenant-a")
    assert ops.startswith("tga_")

    for _ in range(3):  # refused alike on every call (cached for the key cache's period, like an unknown key)
        submit = await refusal(
            stack.gateway.SubmitTask(gateway_pb2.SubmitTaskRequest(prompt="a fox"), metadata=bearer(ops))
        )
        assert submit.code() is grpc.StatusCode.PERMISSION_DENIED and "admin key is not accepted" in (
            submit.details() or ""
        )
    watch = stack.events.WatchTasks(events_pb2.WatchTasksRequest(), metadata=bearer(ops))
    streamed = await refusal(watch.read())
    assert streamed.code() is grpc.StatusCode.PERMISSION_DENIED, streamed
    assert await backends.pool.fetchval("SELECT count(*) FROM task") == 0 and not await backends.pool.fetchval(
        "SELECT count(*) FROM tenant WHERE id = 'alice'"
    )  # an admin credential is no tenant: nothing can be submitted as it

    for _ in range(3):
        stats = await refusal(stack.admin.GetStats(admin_pb2.GetStatsRequest(), metadata=bearer(tenant)))
        assert stats.code() is grpc.StatusCode.PERMISSION_DENIED and "tenant API key is not one" in (
            stats.details() or ""
        )
    assert (await stack.admin.GetStats(admin_pb2.GetStatsRequest(), metadata=bearer(ops))).capacity >= 0


async def test_a_read_only_admin_looks_but_does_not_act_and_an_expired_key_stops_working(
    stack: ApiStack, backends: Backends
) -> None:
    pepper = backends.settings.api_key_pepper
    reader, _ = await auth.create_admin_key(backends.pool, pepper, "auditor", scope=auth.READ)
    await stack.admin.GetStats(admin_pb2.GetStatsRequest(), metadata=bearer(reader))
    await stack.admin.ListAuditEvents(admin_pb2.ListAuditEventsRequest(), metadata=bearer(reader))
    await stack.admin.Authorize(
        admin_pb2.AuthorizeRequest(action="worker.status", target="w1"), metadata=bearer(reader)
    )
    for acting in (
        stack.admin.PurgeTasks(
            admin_pb2.PurgeTasksRequest(older_than=Duration(seconds=0), dry_run=True), metadata=bearer(reader)
        ),
        stack.admin.RevokeApiKeys(admin_pb2.RevokeApiKeysRequest(prefix="tg_xxxxxxx"), metadata=bearer(reader)),
        stack.admin.Authorize(admin_pb2.AuthorizeRequest(action="worker.drain", target="w1"), metadata=bearer(reader)),
    ):
        denied = await refusal(acting)
        assert denied.code() is grpc.StatusCode.PERMISSION_DENIED and "read-only" in (denied.details() or ""), denied
    assert await backends.pool.fetchval("SELECT count(*) FROM admin_audit") == 0  # refused: nothing was done

    brief, expires = await auth.create_admin_key(
        backends.pool, pepper, "contractor", scope=auth.OPERATOR, expires_in_seconds=1.5
    )
    assert expires is not None
    await stack.admin.GetStats(admin_pb2.GetStatsRequest(), metadata=bearer(brief))  # good, and cached

    async def expired() -> bool:
        try:
            await stack.admin.GetStats(admin_pb2.GetStatsRequest(), metadata=bearer(brief))
        except grpc.aio.AioRpcError as exc:
            assert exc.code() is grpc.StatusCode.UNAUTHENTICATED and "expired" in (exc.details() or ""), exc
            return True
        return False

    await wait_for(expired, within=10)
    assert await backends.pool.fetchval("SELECT now()") >= expires - timedelta(seconds=0.1)


async def test_every_acting_call_is_in_the_audit_log_readable_over_task_admin_and_the_cli(
    stack: ApiStack, backends: Backends, tmp_path: object
) -> None:
    pepper = backends.settings.api_key_pepper
    alice, _ = await auth.create_admin_key(backends.pool, pepper, "alice", scope=auth.OPERATOR)
    reader, _ = await auth.create_admin_key(backends.pool, pepper, "auditor", scope=auth.READ)
    victim, _ = await auth.create_key(backends.pool, pepper, "tenant-a")
    md = bearer(alice)
    await stack.admin.PurgeTasks(
        admin_pb2.PurgeTasksRequest(older_than=Duration(seconds=3600), dry_run=True), metadata=md
    )
    await stack.admin.PurgeTasks(admin_pb2.PurgeTasksRequest(older_than=Duration(seconds=3600)), metadata=md)
    await stack.admin.RotateWebhookSecret(admin_pb2.RotateWebhookSecretRequest(tenant="tenant-a"), metadata=md)
    await stack.admin.RevokeApiKeys(admin_pb2.RevokeApiKeysRequest(prefix=victim[:10]), metadata=md)
    await stack.admin.GetStats(admin_pb2.GetStatsRequest(), metadata=md)  # looking is no action

    listed = await stack.admin.ListAuditEvents(admin_pb2.ListAuditEventsRequest(page_size=3), metadata=bearer(reader))
    rest = await stack.admin.ListAuditEvents(
        admin_pb2.ListAuditEventsRequest(page_size=3, page_token=listed.next_page_token), metadata=bearer(reader)
    )
    events = [*listed.events, *rest.events]
    assert [(e.admin, e.action, e.target, e.dry_run) for e in events] == [
        ("alice", "RevokeApiKeys", victim[:10], False),
        ("alice", "RotateWebhookSecret", "tenant-a", False),
        ("alice", "PurgeTasks", "", False),
        ("alice", "PurgeTasks", "", True),
    ] and not rest.next_page_token
    assert all(e.prefix == alice[:10] and e.HasField("at") for e in events)
    assert json.loads(events[3].detail) == {"older_than": "3600s", "dry_run": True}
    assert "whsec_" not in events[1].detail  # the request is recorded, never the secret answered

    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "taskgate_client.cli", "admin", "audit", "--by", "alice", "--limit", "2", "--json",
        "--admin-address", f"127.0.0.1:{stack.admin_port}", "--admin-key", reader,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
    )
    out, _ = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 0, out
    assert [e["action"] for e in json.loads(out)["events"]] == ["RevokeApiKeys", "RotateWebhookSecret"]
