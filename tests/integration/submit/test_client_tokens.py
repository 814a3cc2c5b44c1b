"""Short-lived client tokens (#35): a backend mints, with its tenant's secret (offline, the SDK) or by
CreateClientToken, a token for one end user's tasks; the gateway and the notifier accept it for GetTask, results,
WatchTask/WatchTasks and (when scoped) CancelTask, and refuse it everywhere else and in every way it can be wrong."""

from __future__ import annotations

import asyncio
import base64
import json
import time
from typing import Any

import grpc
import jwt
import pytest
from google.protobuf.duration_pb2 import Duration

from services.notifier.service import start as start_notifier
from services.submit.service import start
from taskgate import clienttokens, store
from taskgate.config import Settings
from taskgate.runtime import Backends
from taskgate_api.client_tokens import Secret
from taskgate_api.v1 import events_pb2, events_pb2_grpc, gateway_pb2, gateway_pb2_grpc, task_pb2
from taskgate_client import mint_client_token
from tests.support.factories import Metadata, key_for
from tests.support.harness import error_info, info_of, outcome

ANN, BOB = "ann", "bob"


def bearer(token: str) -> Metadata:
    return (("authorization", f"Bearer {token}"),)


async def _tasks(stub: Any, md: Metadata) -> dict[str, str]:
    """One task of ann, one of bob and one of the tenant itself; their ids by owner."""
    out = {}
    for who in (ANN, BOB, ""):
        made = await stub.SubmitTask(
            gateway_pb2.SubmitTaskRequest(prompt=f"for {who}", end_user=who), metadata=md, timeout=5
        )
        out[who] = made.task.id
    return out


async def _secret(stub: Any, md: Metadata, **fields: Any) -> str:
    response = await stub.GetClientTokenSecret(
        gateway_pb2.GetClientTokenSecretRequest(**fields), metadata=md, timeout=5
    )
    return str(response.secret)


async def _get(stub: Any, token: str, task_id: str) -> tuple[grpc.StatusCode, list[Any], Any]:
    return await outcome(stub.GetTask(gateway_pb2.GetTaskRequest(task_id=task_id), metadata=bearer(token), timeout=5))


async def test_a_token_reads_its_end_users_tasks_only(stub: Any, backends: Backends) -> None:
    md = await key_for(backends, max_pending=20)
    ids = await _tasks(stub, md)
    secret = await _secret(stub, md)
    assert await _secret(stub, md) == secret  # the same secret until rotated
    token = mint_client_token(secret, ANN)  # offline, with the SDK

    code, _, got = await _get(stub, token, ids[ANN])
    assert code == grpc.StatusCode.OK and got.task.end_user == ANN
    assert got.suggested_poll_interval.ToMilliseconds() > 0
    for other in (ids[BOB], ids[""]):  # another end user's task, and the tenant's own: as if they did not exist
        code, _, _ = await _get(stub, token, other)
        assert code == grpc.StatusCode.NOT_FOUND
    other_tenant = await key_for(backends, "tenant-b")
    theirs = await stub.SubmitTask(
        gateway_pb2.SubmitTaskRequest(prompt="b", end_user=ANN), metadata=other_tenant, timeout=5
    )
    assert (await _get(stub, token, theirs.task.id))[0] == grpc.StatusCode.NOT_FOUND  # same end user name, other tenant

    # the API key's calls stay the API key's: submitting, listing, minting
    code, details, _ = await outcome(
        stub.SubmitTask(gateway_pb2.SubmitTaskRequest(prompt="x"), metadata=bearer(token), timeout=5)
    )
    assert code == grpc.StatusCode.PERMISSION_DENIED and info_of(details).reason == "CLIENT_TOKEN_NOT_ACCEPTED"
    code, _, _ = await outcome(stub.ListTasks(gateway_pb2.ListTasksRequest(), metadata=bearer(token), timeout=5))
    assert code == grpc.StatusCode.PERMISSION_DENIED
    code, _, _ = await outcome(stub.CreateClientToken(gateway_pb2.CreateClientTokenRequest(end_user=ANN),
                                                      metadata=bearer(token), timeout=5))
    assert code == grpc.StatusCode.PERMISSION_DENIED

    # a token limited to listed tasks
    listed = mint_client_token(secret, ANN, task_ids=[ids[ANN]])
    second = await stub.SubmitTask(gateway_pb2.SubmitTaskRequest(prompt="again", end_user=ANN), metadata=md, timeout=5)
    assert (await _get(stub, listed, ids[ANN]))[0] == grpc.StatusCode.OK
    assert (await _get(stub, listed, second.task.id))[0] == grpc.StatusCode.NOT_FOUND

    # minted by the gateway for a caller without the SDK
    ttl = Duration(seconds=60)
    made = await stub.CreateClientToken(
        gateway_pb2.CreateClientTokenRequest(end_user=BOB, scopes=["read"], ttl=ttl), metadata=md, timeout=5
    )
    assert 50 < made.expires_at.ToSeconds() - time.time() <= 61
    assert (await _get(stub, made.token, ids[BOB]))[0] == grpc.StatusCode.OK
    assert (await _get(stub, made.token, ids[ANN]))[0] == grpc.StatusCode.NOT_FOUND
    for bad in (gateway_pb2.CreateClientTokenRequest(end_user=BOB, scopes=["write"]),
                gateway_pb2.CreateClientTokenRequest(end_user=BOB, ttl=Duration(seconds=3601)),
                gateway_pb2.CreateClientTokenRequest(end_user="x" * 200)):
        code, _, _ = await outcome(stub.CreateClientToken(bad, metadata=md, timeout=5))
        assert code == grpc.StatusCode.INVALID_ARGUMENT


async def test_every_way_a_token_can_be_wrong_is_refused(stub: Any, backends: Backends, settings: Settings) -> None:
    md = await key_for(backends, max_pending=20)
    ids = await _tasks(stub, md)
    secret = await _secret(stub, md)
    parsed = Secret.parse(secret)

    def refused(code: grpc.StatusCode) -> bool:
        return code == grpc.StatusCode.UNAUTHENTICATED

    # expired (minted an hour and a minute ago for an hour)
    old = clienttokens.mint(parsed.key, parsed.kid, parsed.tenant_id, ANN, ttl_seconds=3600, now=time.time() - 3660)
    assert refused((await _get(stub, old, ids[ANN]))[0])
    # tampered: another end user written into a token signed for ann
    good = mint_client_token(secret, ANN)
    head, body, signature = good.split(".")
    claims = json.loads(base64.urlsafe_b64decode(body + "=" * (-len(body) % 4)))
    claims["sub"] = BOB
    forged = base64.urlsafe_b64encode(json.dumps(claims).encode()).decode().rstrip("=")
    assert refused((await _get(stub, f"{head}.{forged}.{signature}", ids[BOB]))[0])
    # another tenant's secret claiming this tenant: the signature does not match this tenant's key
    other_md = await key_for(backends, "tenant-b")
    theirs = Secret.parse(await _secret(stub, other_md))
    posing = clienttokens.mint(theirs.key, parsed.kid, parsed.tenant_id, ANN)
    assert refused((await _get(stub, posing, ids[ANN]))[0])
    # a lifetime over an hour, signed correctly, and an unknown key id
    long_lived = jwt.encode({"iss": "taskgate", "ten": parsed.tenant_id, "sub": ANN, "scope": "read",
                             "iat": int(time.time()), "exp": int(time.time()) + 7200}, parsed.key, algorithm="HS256",
                            headers={"kid": parsed.kid})
    assert refused((await _get(stub, long_lived, ids[ANN]))[0])
    unknown_kid = clienttokens.mint(clienttokens.signing_key(settings.api_key_pepper, parsed.tenant_id, "nope"), "nope",
                                    parsed.tenant_id, ANN)
    assert refused((await _get(stub, unknown_kid, ids[ANN]))[0])
    assert refused((await _get(stub, "eyJ.not.atoken", ids[ANN]))[0])

    # scopes: read cannot cancel; cancel can, its own end user's task only
    reader = mint_client_token(secret, ANN, scopes=["read"])
    code, details, _ = await outcome(stub.CancelTask(gateway_pb2.CancelTaskRequest(task_id=ids[ANN]),
                                                     metadata=bearer(reader), timeout=5))
    assert code == grpc.StatusCode.PERMISSION_DENIED and info_of(details).reason == "CLIENT_TOKEN_SCOPE"
    canceller = mint_client_token(secret, ANN, scopes=["read", "cancel"])
    code, _, _ = await outcome(stub.CancelTask(gateway_pb2.CancelTaskRequest(task_id=ids[BOB]),
                                               metadata=bearer(canceller), timeout=5))
    assert code == grpc.StatusCode.NOT_FOUND
    done = await stub.CancelTask(gateway_pb2.CancelTaskRequest(task_id=ids[ANN]), metadata=bearer(canceller), timeout=5)
    assert done.task.status == task_pb2.TASK_STATUS_CANCELED and done.task.end_user == ANN


async def test_a_rotated_out_secret_works_through_its_grace_then_not(
    stub: Any, backends: Backends, settings: Settings
) -> None:
    md = await key_for(backends, max_pending=20)
    ids = await _tasks(stub, md)
    first = await _secret(stub, md)
    before = mint_client_token(first, ANN)
    second = await _secret(stub, md, rotate=True, overlap=Duration(seconds=3600))
    assert second != first and await _secret(stub, md) == second
    assert (await _get(stub, before, ids[ANN]))[0] == grpc.StatusCode.OK  # within its grace
    assert (await _get(stub, mint_client_token(second, ANN), ids[ANN]))[0] == grpc.StatusCode.OK
    # a rotation with no grace: tokens of the secrets before it stop at once (a replica that read the tenant's key ids
    # before may accept them for up to its key cache's period; this one has read none)
    third = await _secret(stub, md, rotate=True, overlap=Duration(seconds=0))
    replica = await start(settings)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{replica.port}") as channel:
            fresh = gateway_pb2_grpc.TaskGatewayStub(channel)
            for old in (before, mint_client_token(second, ANN)):
                code, _, _ = await _get(fresh, old, ids[ANN])
                assert code == grpc.StatusCode.UNAUTHENTICATED
            assert (await _get(fresh, mint_client_token(third, ANN), ids[ANN]))[0] == grpc.StatusCode.OK
    finally:
        await replica.stop(0)


async def test_a_tokens_event_stream_carries_its_end_users_events_only(
    stub: Any, backends: Backends, settings: Settings
) -> None:
    md = await key_for(backends, max_pending=20)
    secret = await _secret(stub, md)
    notifier = await start_notifier(settings, backends)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{notifier.port}") as channel:
            events = events_pb2_grpc.TaskEventsStub(channel)
            watcher = mint_client_token(secret, ANN, scopes=["watch"])
            stream = events.WatchTasks(events_pb2.WatchTasksRequest(), metadata=bearer(watcher))
            assert (await stream.read()).WhichOneof("kind") == "keepalive"  # caught up
            ids = await _tasks(stub, md)
            await store.cancel(backends.pool, int(ids[BOB]), mode=store.CancelMode.HARD, actor="test")
            await store.cancel(backends.pool, int(ids[ANN]), mode=store.CancelMode.HARD, actor="test")
            seen: list[tuple[str, str]] = []
            async with asyncio.timeout(15):
                while not seen or seen[-1][1] != "TASK_STATUS_CANCELED":
                    msg = await stream.read()
                    if msg.WhichOneof("kind") == "event":
                        seen.append((msg.event.task_id, task_pb2.TaskStatus.Name(msg.event.to_status)))
            stream.cancel()
            assert {task for task, _ in seen} == {ids[ANN]}  # bob's and the tenant's events never reached it
            # WatchTask of another end user's task: NOT_FOUND; a read-only token cannot watch at all
            with pytest.raises(grpc.aio.AioRpcError) as err:
                call = events.WatchTask(events_pb2.WatchTaskRequest(task_id=ids[BOB]), metadata=bearer(watcher))
                await call.read()
            assert err.value.code() == grpc.StatusCode.NOT_FOUND
            reader = mint_client_token(secret, ANN, scopes=["read"])
            with pytest.raises(grpc.aio.AioRpcError) as err:
                call = events.WatchTask(events_pb2.WatchTaskRequest(task_id=ids[ANN]), metadata=bearer(reader))
                await call.read()
            assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
            assert error_info(err.value).reason == "CLIENT_TOKEN_SCOPE"
    finally:
        await notifier.stop()
