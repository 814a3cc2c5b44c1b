"""The people behind a tenant (#35): each task names its end user; idempotency keys and derived request hashes are
each end user's own; a request without one belongs to the tenant itself, as before."""

from __future__ import annotations

from typing import Any

import grpc

from taskgate.runtime import Backends
from taskgate_api.v1 import gateway_pb2, task_pb2
from tests.support.factories import key_for
from tests.support.harness import outcome, violations


async def test_the_end_user_is_stored_returned_and_recorded_in_the_history(stub: Any, backends: Backends) -> None:
    md = await key_for(backends, max_pending=10)
    made = await stub.SubmitTask(gateway_pb2.SubmitTaskRequest(prompt="a cat", end_user="user-17"), metadata=md, timeout=5)
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
    batch = await stub.SubmitTasks(gateway_pb2.SubmitTasksRequest(requests=[
        gateway_pb2.SubmitTaskRequest(prompt="batch", idempotency_key="k-2", end_user=who) for who in ("a", "b", "a", "b")
    ]), metadata=md, timeout=5)
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
