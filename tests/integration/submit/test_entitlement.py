"""HIGH priority is an entitlement of the tenant, and RegenerateTask: both through real gRPC (stub and SDK)."""

from __future__ import annotations

from typing import Any

import grpc
import pytest
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from services.submit.service import SubmitHandle
from taskgate.runtime import Backends
from taskgate.states import Priority
from taskgate.store import tenants
from taskgate_api.v1 import gateway_pb2, task_pb2
from taskgate_client import connect_async
from taskgate_client.errors import TaskgateError
from tests.support.factories import key_for
from tests.support.harness import details_of

HIGH, NORMAL, LOW = task_pb2.PRIORITY_HIGH, task_pb2.PRIORITY_NORMAL, task_pb2.PRIORITY_LOW


def request(prompt: str = "a red fox in the snow", **fields: Any) -> gateway_pb2.SubmitTaskRequest:
    params = task_pb2.VideoParams(
        num_frames=9, width=32, height=32, num_inference_steps=2, fps=8, negative_prompt="blur"
    )
    return gateway_pb2.SubmitTaskRequest(prompt=prompt, params=params, **fields)


async def refusal(call: Any) -> tuple[grpc.StatusCode, error_details_pb2.ErrorInfo]:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call
    status = rpc_status.from_call(info.value)
    assert status is not None
    found = [d for d in details_of(status) if isinstance(d, error_details_pb2.ErrorInfo)]
    return info.value.code(), found[0]


async def test_high_is_refused_unless_the_tenant_may_use_it(stub: Any, backends: Backends) -> None:
    plain = await key_for(backends, "plain")
    code, info = await refusal(stub.SubmitTask(request(priority=HIGH), metadata=plain, timeout=10))
    assert code == grpc.StatusCode.PERMISSION_DENIED
    assert info.reason == "PRIORITY_NOT_ALLOWED" and dict(info.metadata) == {"requested": "HIGH", "allowed": "NORMAL"}
    assert await backends.pool.fetchval("SELECT count(*) FROM task") == 0
    for allowed in (NORMAL, LOW, task_pb2.PRIORITY_UNSPECIFIED):
        assert (await stub.SubmitTask(request(f"at {allowed}", priority=allowed), metadata=plain, timeout=10)).created

    paying = await key_for(backends, "paying", max_priority=Priority.HIGH)
    done = await stub.SubmitTask(request(priority=HIGH), metadata=paying, timeout=10)
    assert done.created and done.task.priority == HIGH

    # Lowered later (the tenant command's store call): refused again once the gateway's key cache lets go.
    changed = await tenants.update_tenant(
        backends.pool, "paying", max_pending=None, submits_per_minute=None, max_priority=Priority.LOW
    )
    assert changed is not None and changed.max_priority == Priority.LOW and changed.max_pending is None
    fresh = await key_for(backends, "paying")  # a new key: not in the cache
    code, info = await refusal(stub.SubmitTask(request("normal now", priority=NORMAL), metadata=fresh, timeout=10))
    assert code == grpc.StatusCode.PERMISSION_DENIED and dict(info.metadata)["allowed"] == "LOW"
    assert (
        await tenants.update_tenant(backends.pool, "nobody", max_pending=1, submits_per_minute=None, max_priority=None)
        is None
    )


async def _finished(stub: Any, md: Any, prompt: str, **fields: Any) -> gateway_pb2.SubmitTaskResponse:
    """A task of the caller's that is finished (cancelled while QUEUED: no worker runs here)."""
    submitted = await stub.SubmitTask(request(prompt, **fields), metadata=md, timeout=10)
    await stub.CancelTask(gateway_pb2.CancelTaskRequest(task_id=submitted.task.id), metadata=md, timeout=10)
    return submitted


async def test_regenerate_makes_a_new_task_from_a_finished_ones_request(stub: Any, backends: Backends) -> None:
    paying = await key_for(backends, "paying", max_priority=Priority.HIGH)
    source = (await _finished(stub, paying, "again please", metadata={"job": "7"}, max_retries=1)).task
    again = await stub.RegenerateTask(gateway_pb2.RegenerateTaskRequest(task_id=source.id), metadata=paying, timeout=10)
    new = again.task
    assert again.created and again.source_task_id == source.id and new.id != source.id
    assert new.status == task_pb2.TASK_STATUS_CREATED and new.priority == HIGH
    assert new.idempotency_key != source.idempotency_key
    assert (new.prompt, new.model_id, dict(new.metadata), new.max_retries) == (
        "again please",
        source.model_id,
        {"job": "7"},
        1,
    )
    same = ("num_frames", "width", "height", "num_inference_steps", "fps", "negative_prompt", "guidance_scale")
    assert all(getattr(new.params, f) == getattr(source.params, f) for f in same)

    # A given seed is used; a given key makes the call safe to retry.
    call = gateway_pb2.RegenerateTaskRequest(task_id=source.id, seed=42, idempotency_key="regen-1")
    first = await stub.RegenerateTask(call, metadata=paying, timeout=10)
    retried = await stub.RegenerateTask(call, metadata=paying, timeout=10)
    assert first.created and not retried.created and retried.task.id == first.task.id and first.task.params.seed == 42

    # A tenant without HIGH regenerates at its highest allowed priority.
    plain = await key_for(backends, "plain")
    low = (await _finished(stub, plain, "a plain one", priority=LOW)).task
    regenerated = await stub.RegenerateTask(
        gateway_pb2.RegenerateTaskRequest(task_id=low.id), metadata=plain, timeout=10
    )
    assert regenerated.task.priority == NORMAL


async def test_regenerate_refuses_unfinished_and_other_tenants_tasks(stub: Any, backends: Backends) -> None:
    owner, other = await key_for(backends, "owner"), await key_for(backends, "other")
    running = (await stub.SubmitTask(request("still queued"), metadata=owner, timeout=10)).task
    code, info = await refusal(
        stub.RegenerateTask(gateway_pb2.RegenerateTaskRequest(task_id=running.id), metadata=owner, timeout=10)
    )
    assert code == grpc.StatusCode.FAILED_PRECONDITION and info.reason == "TASK_NOT_FINISHED"
    done = (await _finished(stub, owner, "done")).task
    code, _ = await refusal(
        stub.RegenerateTask(gateway_pb2.RegenerateTaskRequest(task_id=done.id), metadata=other, timeout=10)
    )
    assert code == grpc.StatusCode.NOT_FOUND


async def test_the_sdk_regenerates_and_reports_the_priority_refusal(
    gateway: SubmitHandle, stub: Any, backends: Backends
) -> None:
    md = await key_for(backends, "plain")
    api_key = md[0][1].removeprefix("Bearer ")
    async with connect_async(f"127.0.0.1:{gateway.port}", api_key) as client:
        with pytest.raises(TaskgateError) as info:
            await client.submit("too eager", frames=9, width=32, height=32, steps=2, priority="high")
        assert info.value.code == grpc.StatusCode.PERMISSION_DENIED and info.value.reason == "PRIORITY_NOT_ALLOWED"
        source = await client.submit("fine", frames=9, width=32, height=32, steps=2)
        await client.cancel(source.task_id)
        again = await client.regenerate(source.task_id, seed=7)
        assert again.task_id != source.task_id and again.priority == "normal" and again.created
