"""Operations over TaskAdmin through the SDK: webhook-secret rotation (both secrets sign), API keys, failed
deliveries."""

from __future__ import annotations

import asyncio
import json
import sys
import time
from collections.abc import AsyncIterator

import pytest

from services.notifier.service import start as start_notifier
from services.scheduler import service as scheduler_service
from services.submit import service as submit_service
from taskgate import auth
from taskgate.runtime import Backends
from taskgate.sealing import Sealer
from taskgate.states import Status
from taskgate.store import tenants
from taskgate_api.v1 import task_pb2
from taskgate_client import AsyncTaskgateClient, connect_async
from taskgate_client.errors import TaskgateError
from tests.support.factories import all_settings, insert_task
from tests.support.harness import wait_for
from tests.support.notifier import TENANT, fast, independent_signature, run_to
from tests.support.webhooks import Reply, WebhookReceiver


@pytest.fixture
async def ops(backends: Backends) -> AsyncIterator[AsyncTaskgateClient]:
    """An SDK client holding an admin key, talking to a scheduler's TaskAdmin (scan loop off)."""
    handle = await scheduler_service.start(all_settings(backends), backends, scan_loop=False)
    admin_key, _ = await auth.create_key(backends.pool, backends.settings.api_key_pepper, "ops", admin=True)
    address = f"127.0.0.1:{handle.port}"
    try:
        async with connect_async(address, admin_key, admin_address=address, admin_key=admin_key) as client:
            yield client
    finally:
        await handle.stop()


async def test_rotation_signs_with_both_secrets_until_the_overlap_ends(
    backends: Backends, ops: AsyncTaskgateClient
) -> None:
    _, old = await auth.create_key(backends.pool, backends.settings.api_key_pepper, TENANT)
    assert old is not None
    rotated = await ops.rotate_webhook_secret(TENANT, overlap=3600)
    new = rotated.webhook_secret
    assert new.startswith("whsec_") and new != old and rotated.valid_secrets == 2
    assert set(await auth.webhook_secrets(backends.pool, TENANT, Sealer.of(backends.settings))) == {old, new}

    async with WebhookReceiver(lambda _r: Reply(204, body=b"")) as rx:
        notifier = await start_notifier(fast(all_settings(backends)), backends)
        try:
            task = await insert_task(backends.pool, callback_url=rx.url())
            await run_to(backends.pool, task.id, Status.SUCCEEDED)
            await wait_for(lambda: len(rx.requests) == 1)
        finally:
            await notifier.stop()
    # The notifier signs with every valid secret: a receiver holding either one verifies the webhook.
    signatures = rx.requests[0].headers["webhook-signature"].split()
    assert sorted(signatures) == sorted(independent_signature(s, rx.requests[0]) for s in (old, new))

    # Overlap 0 retires the current secrets at once: only the newest signs.
    again = await ops.rotate_webhook_secret(TENANT, overlap=0)
    assert again.valid_secrets == 1 and await auth.webhook_secrets(
        backends.pool, TENANT, Sealer.of(backends.settings)
    ) == [again.webhook_secret]

    for tenant, code in (
        ("no-such-tenant", "NOT_FOUND"),
        ("bad name", "INVALID_ARGUMENT"),
        ("nul\x00", "INVALID_ARGUMENT"),
    ):
        with pytest.raises(TaskgateError) as info:
            await ops.rotate_webhook_secret(tenant)
        assert info.value.code_name == code, tenant


async def test_a_tenant_rotates_its_own_webhook_secret_over_task_gateway(backends: Backends) -> None:
    pepper = backends.settings.api_key_pepper
    key, old = await auth.create_key(backends.pool, pepper, TENANT)
    _, theirs = await auth.create_key(backends.pool, pepper, "another-tenant")
    gateway = await submit_service.start(all_settings(backends), backends)
    address = f"127.0.0.1:{gateway.port}"
    try:
        async with connect_async(address, key) as client:
            rotated = await client.rotate_own_webhook_secret(overlap=600)
            assert rotated.webhook_secret.startswith("whsec_") and rotated.valid_secrets == 2
            assert set(await auth.webhook_secrets(backends.pool, TENANT, Sealer.of(backends.settings))) == {
                old,
                rotated.webhook_secret,
            }
            assert abs(rotated.previous_valid_until.ToSeconds() - (time.time() + 600)) < 60
            theirs_now = await auth.webhook_secrets(backends.pool, "another-tenant", Sealer.of(backends.settings))
            assert theirs_now == [theirs]  # only the caller's own
            with pytest.raises(TaskgateError) as too_long:
                await client.rotate_own_webhook_secret(overlap=8 * 86400)
            assert too_long.value.code_name == "INVALID_ARGUMENT" and "overlap" in str(too_long.value.field_violations)

        # the CLI, as a tenant runs it: --overlap 0 retires the old secrets at once
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "taskgate_client.cli", "rotate-webhook-secret", "--overlap", "0", "--json",
            "--address", address, "--api-key", key, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
        )
        out, _ = await asyncio.wait_for(proc.communicate(), 60)
        assert proc.returncode == 0, out
        shown = json.loads(out)
        assert shown["valid_secrets"] == 1 and await auth.webhook_secrets(
            backends.pool, TENANT, Sealer.of(backends.settings)
        ) == [shown["webhook_secret"]]

        async with connect_async(address, "tg_not-a-key") as stranger:
            with pytest.raises(TaskgateError) as nobody:
                await stranger.rotate_own_webhook_secret()
        assert nobody.value.code_name == "UNAUTHENTICATED"
    finally:
        await gateway.stop(0)


async def test_keys_are_listed_and_revoked_over_task_admin(backends: Backends, ops: AsyncTaskgateClient) -> None:
    pepper = backends.settings.api_key_pepper
    first, _ = await auth.create_key(backends.pool, pepper, "acme")
    second, _ = await auth.create_key(backends.pool, pepper, "acme")
    listed = await ops.api_keys("acme")
    assert [k.prefix for k in listed] == [second[:10], first[:10]] and not any(k.admin for k in listed)
    assert {k.tenant for k in await ops.api_keys()} == {"acme", "ops"}

    assert await ops.revoke_api_keys(first[:10]) == 1
    after = {k.prefix: k for k in await ops.api_keys("acme")}
    assert after[first[:10]].HasField("revoked_at") and not after[second[:10]].HasField("revoked_at")
    assert await tenants.lookup_api_key(backends.pool, auth.hash_key(pepper, first)) is None
    with pytest.raises(TaskgateError) as info:
        await ops.revoke_api_keys(first[:10])
    assert info.value.code_name == "NOT_FOUND"

    async with connect_async(ops.config.address, second, admin_address=ops.config.admin_address) as tenant_only:
        with pytest.raises(TaskgateError) as info:
            await tenant_only.api_keys()
        assert info.value.code_name == "PERMISSION_DENIED"


async def test_failed_deliveries_are_listed_with_their_last_error(backends: Backends, ops: AsyncTaskgateClient) -> None:
    await auth.create_key(backends.pool, backends.settings.api_key_pepper, TENANT)
    async with WebhookReceiver(lambda _r: Reply(503, body=b"down")) as rx:
        notifier = await start_notifier(fast(all_settings(backends), webhook_schedule_seconds=[0.0, 0.1]), backends)
        try:
            failed = await insert_task(backends.pool, callback_url=rx.url())
            await run_to(backends.pool, failed.id, Status.FAILED)

            async def given_up() -> bool:
                return [d.task_id async for d in ops.deliveries("FAILED")] == [str(failed.id)]

            await wait_for(given_up)
        finally:
            await notifier.stop()
    [record] = [d async for d in ops.deliveries("failed")]
    assert record.status == task_pb2.CALLBACK_STATUS_FAILED and record.tenant == TENANT and record.url == rx.url()
    assert record.attempts == 2 and record.last_status_code == 503 and record.event == "task.failed"
    assert record.HasField("last_attempt_at") and not record.HasField("next_attempt_at")
    assert [d.task_id async for d in ops.deliveries("DELIVERED")] == []
    assert [d.delivery_id async for d in ops.deliveries(page_size=1)] == [record.delivery_id]
