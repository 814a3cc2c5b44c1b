"""The people behind a tenant (#35): each task names its end user; idempotency keys and derived request hashes are
each end user's own; a request without one belongs to the tenant itself, as before."""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
from google.rpc import error_details_pb2

from services.submit.service import start
from taskgate.config import Settings
from taskgate.runtime import Backends
from taskgate.store import tenants
from taskgate_api.v1 import gateway_pb2, gateway_pb2_grpc, task_pb2
from tests.support.factories import Metadata, key_for
from tests.support.harness import info_of, outcome, violations


async def test_the_end_user_is_stored_returned_and_recorded_in_the_history(stub: Any, backends: Backends) -> None:
    md = await key_for(backends, max_pending=10)
    made = await stub.SubmitTask(
        gateway_pb2.SubmitTaskRequest(prompt="a cat", end_user="user-17"), metadata=md, timeout=5
    )
    assert made.created and made.task.end_user == "user-17"
    got = await stub.GetTask(gateway_pb2.GetTaskRequest(task_id=made.task.id), metadata=md, timeout=5)
    assert got.task.end_user == "user-17"
    row = await backends.pool.fetchrow("SELECT end_user FROM task WHERE id = $1", int(made.task.id))
    assert row["end_user"] == "user-17"
    events = await backends.pool.fetch("SELECT end_user FROM task_event WHERE task_id = $1", int(made.task.id))
    assert events and {e["end_user"] for e in events} == {"user-17"}
    mine = await stub.SubmitTask(gateway_pb2.SubmitTaskRequest(prompt="a cat"), metadata=md, timeout=5)
    assert mine.created and mine.task.end_user == ""  # the tenant's own task, as before


async def test_one_key_from_two_end_users_is_two_tasks(stub: Any, backends: Backends) -> None:
    md = await key_for(backends, max_pending=10)

    def ask(end_user: str, key: str = "k-1") -> Any:
        request = gateway_pb2.SubmitTaskRequest(prompt="same prompt", idempotency_key=key, end_user=end_user)
        return stub.SubmitTask(request, metadata=md, timeout=5)

    alice, bob, tenant = await ask("alice"), await ask("bob"), await ask("")
    assert alice.created and bob.created and tenant.created
    assert len({alice.task.id, bob.task.id, tenant.task.id}) == 3
    again = await ask("alice")  # a retry by the same end user finds its task
    assert not again.created and again.task.id == alice.task.id
    # a batch holding both end users' copies of one key: one task each, the later copy of each answers with it
    batch = await stub.SubmitTasks(
        gateway_pb2.SubmitTasksRequest(
            requests=[
                gateway_pb2.SubmitTaskRequest(prompt="batch", idempotency_key="k-2", end_user=who)
                for who in ("a", "b", "a", "b")
            ]
        ),
        metadata=md,
        timeout=5,
    )
    ids = [r.response.task.id for r in batch.results]
    assert ids[0] == ids[2] and ids[1] == ids[3] and ids[0] != ids[1]
    assert [r.response.created for r in batch.results] == [True, True, False, False]


async def test_derived_keys_are_each_end_users_own(stub: Any, backends: Backends) -> None:
    md = await key_for(backends, max_pending=10)

    async def ask(end_user: str) -> Any:
        return await stub.SubmitTask(
            gateway_pb2.SubmitTaskRequest(prompt="two people, one prompt", idempotency_key="", end_user=end_user,
                                          params=task_pb2.VideoParams(seed=7)),
            metadata=md, timeout=5,
        )

    alice, bob = await ask("alice"), await ask("bob")
    assert alice.created and bob.created and alice.task.id != bob.task.id
    assert alice.task.idempotency_key != bob.task.idempotency_key  # the derived request hash names the end user
    again = await ask("alice")
    assert again.task.id == alice.task.id and not again.created


async def test_a_bad_end_user_is_refused_naming_the_field(stub: Any, backends: Backends) -> None:
    md = await key_for(backends, max_pending=10)
    for bad in ("é" * 65, "x" * 129, "tab\there", " padded", "nul\x00"):
        code, details, _ = await outcome(
            stub.SubmitTask(gateway_pb2.SubmitTaskRequest(prompt="p", end_user=bad), metadata=md, timeout=5)
        )
        assert code == grpc.StatusCode.INVALID_ARGUMENT and violations(details) == {"end_user"}, bad
    ok = await stub.SubmitTask(gateway_pb2.SubmitTaskRequest(prompt="p", end_user="é" * 64), metadata=md, timeout=5)
    assert ok.task.end_user == "é" * 64  # 128 bytes as UTF-8: the longest allowed
    assert await backends.pool.fetchval("SELECT count(*) FROM task") == 1


# Limits per end user, inside the tenant's, exact across submit replicas


async def _burst(settings: Settings, requests: list[tuple[Metadata, gateway_pb2.SubmitTaskRequest]]) -> list[Any]:
    """Every request sent at once, alternately to two submit replicas; (code, details, response) each, in order."""
    replicas = [await start(settings), await start(settings)]  # each with its own pool and NATS connection
    channels = [grpc.aio.insecure_channel(f"127.0.0.1:{r.port}") for r in replicas]
    try:
        stubs = [gateway_pb2_grpc.TaskGatewayStub(c) for c in channels]
        return list(await asyncio.gather(*(
            outcome(stubs[i % 2].SubmitTask(request, metadata=md, timeout=20))
            for i, (md, request) in enumerate(requests)
        )))
    finally:
        for channel in channels:
            await channel.close()
        for replica in replicas:
            await replica.stop(0)


async def test_two_replicas_admit_exactly_three_per_end_user_and_the_tenants_total(
    settings: Settings, backends: Backends
) -> None:
    # a backend is not capped at 3
    assert settings.max_pending_per_end_user == 3 and settings.max_pending_per_tenant > 3
    md = await key_for(backends, max_pending=10)
    people = ["ann", "bob", "cy", "di"]
    results = await _burst(settings, [
        (md, gateway_pb2.SubmitTaskRequest(prompt=f"job {n}", end_user=people[n % 4])) for n in range(32)
    ])
    admitted = [r for code, _, r in results if code == grpc.StatusCode.OK]
    refused = [d for code, d, _ in results if code != grpc.StatusCode.OK]
    assert len(admitted) == 10 and len(refused) == 22  # the tenant's total, across its end users
    assert all(info_of(d).reason == "TOO_MANY_PENDING_TASKS" for d in refused)
    scopes = [info_of(d).metadata["scope"] for d in refused]
    assert set(scopes) == {"end_user", "tenant"}
    assert {info_of(d).metadata["limit"] for d in refused if info_of(d).metadata["scope"] == "end_user"} == {"3"}
    assert {info_of(d).metadata["limit"] for d in refused if info_of(d).metadata["scope"] == "tenant"} == {"10"}
    per_person = dict(await backends.pool.fetch("SELECT end_user, count(*) FROM task GROUP BY end_user"))
    assert sum(per_person.values()) == 10 and max(per_person.values()) == 3

    # one end user alone, on two replicas: exactly three
    other = await key_for(backends, "tenant-b")
    results = await _burst(settings, [
        (other, gateway_pb2.SubmitTaskRequest(prompt=f"mine {n}", end_user="eve")) for n in range(20)
    ])
    assert [code for code, _, _ in results].count(grpc.StatusCode.OK) == 3
    assert {info_of(d).metadata["scope"] for code, d, _ in results if code != grpc.StatusCode.OK} == {"end_user"}
    assert await backends.pool.fetchval("SELECT count(*) FROM task WHERE user_id = 'tenant-b'") == 3


async def test_a_tenants_own_overrides_and_the_per_minute_limit_per_end_user(stub: Any, backends: Backends) -> None:
    md = await key_for(backends, max_pending=50)
    changed = await tenants.update_tenant(
        backends.pool, "tenant-a", max_pending=None, submits_per_minute=None, max_priority=None,
        max_pending_per_end_user=5, submits_per_minute_per_end_user=2,
    )
    assert changed is not None and changed.max_pending_per_end_user == 5

    async def ask(end_user: str, n: int) -> tuple[grpc.StatusCode, list[Any], Any]:
        request = gateway_pb2.SubmitTaskRequest(prompt=f"p{n}", end_user=end_user)
        return await outcome(stub.SubmitTask(request, metadata=md, timeout=5))

    # two go through, the third waits for the next minute (a boundary passing between the calls is allowed for)
    first = [await ask("ann", n) for n in range(3)]
    assert [c for c, _, _ in first][:2] == [grpc.StatusCode.OK] * 2
    code, details, _ = first[2]
    if code == grpc.StatusCode.OK:  # a minute boundary passed between the calls: once more, inside one minute
        code, details, _ = await ask("ann", 3)
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and info_of(details).reason == "RATE_LIMITED"
    assert info_of(details).metadata["scope"] == "end_user" and info_of(details).metadata["limit"] == "2"
    retry = next(d for d in details if isinstance(d, error_details_pb2.RetryInfo))
    assert 0 < retry.retry_delay.ToTimedelta().total_seconds() <= 60
    other = await ask("bob", 0)  # another end user of the same tenant is not held back
    assert other[0] == grpc.StatusCode.OK
    assert await backends.pool.fetchval("SELECT count(*) FROM task WHERE end_user = 'ann'") >= 2
    # the tenant's own overrides: five unfinished tasks each (the per-minute limit lifted for this part)
    await tenants.update_tenant(backends.pool, "tenant-a", max_pending=None, submits_per_minute=None, max_priority=None,
                                submits_per_minute_per_end_user=1000)
    codes = [(await ask("cy", n))[0] for n in range(7)]
    assert codes == [grpc.StatusCode.OK] * 5 + [grpc.StatusCode.RESOURCE_EXHAUSTED] * 2


async def test_two_replicas_count_an_end_users_minute_exactly(settings: Settings, backends: Backends) -> None:
    md = await key_for(backends, max_pending=100)
    await tenants.update_tenant(backends.pool, "tenant-a", max_pending=None, submits_per_minute=None, max_priority=None,
                                max_pending_per_end_user=50, submits_per_minute_per_end_user=5)
    # the next minute's window is full already: a burst straddling a minute boundary cannot get more than this minute's
    await backends.pool.execute(
        "INSERT INTO end_user_rate_window (tenant_id, end_user, window_start, count)"
        " VALUES ('tenant-a', 'ann', date_trunc('minute', now()) + interval '1 minute', 5)"
    )
    results = await _burst(settings, [
        (md, gateway_pb2.SubmitTaskRequest(prompt=f"job {n}", end_user="ann")) for n in range(20)
    ] + [(md, gateway_pb2.SubmitTaskRequest(prompt=f"other {n}", end_user="bob")) for n in range(3)])
    ann, bob = results[:20], results[20:]
    assert [code for code, _, _ in ann].count(grpc.StatusCode.OK) == 5
    refused = [info_of(d) for code, d, _ in ann if code != grpc.StatusCode.OK]
    assert {(i.reason, i.metadata["scope"], i.metadata["limit"]) for i in refused} == {
        ("RATE_LIMITED", "end_user", "5")
    }
    assert all(code == grpc.StatusCode.OK for code, _, _ in bob)  # another end user of the tenant is not held back
    assert await backends.pool.fetchval("SELECT count(*) FROM task WHERE end_user = 'ann'") == 5
