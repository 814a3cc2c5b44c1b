"""SubmitStream: the SDK's submissions pipelined over one stream per channel, against the real gateway, and its fallback
to unary SubmitTask where a server lacks the stream."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from typing import Any

import grpc
import pytest

from services.submit import service as submit_service
from taskgate import auth, store, telemetry
from taskgate_api import reasons
from taskgate_api.v1 import gateway_pb2
from taskgate_client import InvalidArgument
from tests.support.stacks import SMALL, Stack


def _unary_submits() -> float:
    return telemetry.GRPC_REQUESTS.labels("TaskGateway", "SubmitTask", "OK")._value.get()


def _batch_sizes(stack: Stack) -> list[int]:
    """Records the size of every batch the gateway's Batcher admits (one statement each)."""
    batcher = stack.submit.gateway._submitter._admissions
    sizes: list[int] = []
    flush = batcher._flush

    async def counted(items: list[Any]) -> Sequence[Any]:
        sizes.append(len(items))
        return await flush(items)

    batcher._flush = counted
    return sizes


async def test_200_concurrent_submits_share_one_stream_and_each_gets_its_own_task(stack: Stack) -> None:
    sizes = _batch_sizes(stack)
    unary = _unary_submits()
    key = await stack.key("many", max_pending=1000, submits_per_minute=10_000)
    async with stack.client(api_key=key) as client:
        handles = await asyncio.gather(
            *(
                client.submit(f"fox {i}", idempotency_key=f"key-{i}", metadata={"i": str(i)}, **SMALL)  # type: ignore[arg-type]
                for i in range(200)
            )
        )
        assert len(client._pipes) == 1
    assert _unary_submits() == unary  # none went by SubmitTask
    assert len({h.task_id for h in handles}) == 200
    for i, handle in enumerate(handles):  # each caller got the task of its own request, not a neighbour's
        assert handle.created
        row = await store.get_task(stack.backends.pool, int(handle.task_id))
        assert row is not None and row.prompt == f"fox {i}" and row.idempotency_key == f"key-{i}"
    assert sum(sizes) == 200
    assert max(sizes) > 1  # requests that arrived together were admitted by one statement


async def test_an_invalid_request_is_refused_with_its_field_and_the_stream_goes_on(stack: Stack) -> None:
    async with stack.client() as client:
        answers = await asyncio.gather(
            *(client.submit(f"fine {i}", **SMALL) for i in range(10)),  # type: ignore[arg-type]
            client.submit("too many frames", frames=100_000),
            *(client.submit(f"also fine {i}", **SMALL) for i in range(10)),  # type: ignore[arg-type]
            return_exceptions=True,
        )
        refused = answers[10]
        assert isinstance(refused, InvalidArgument), refused
        assert [v.field for v in refused.field_violations] == ["params.num_frames"]
        fine = [a for i, a in enumerate(answers) if i != 10]
        assert all(not isinstance(a, BaseException) and a.created for a in fine), fine
        after = await client.submit("after the refusal", **SMALL)  # type: ignore[arg-type]
        assert after.created
        assert len(client._pipes) == 1


async def test_the_stream_is_opened_again_after_the_gateway_restarts(stack: Stack) -> None:
    async with stack.client() as client:
        first = await client.submit("before the restart", idempotency_key="before", **SMALL)  # type: ignore[arg-type]
        port = stack.submit.port
        await stack.submit.stop(0)
        stack.submit = await submit_service.start(
            stack.settings.model_copy(update={"submit_port": port}), stack.backends
        )
        try:
            unary = _unary_submits()
            again = await asyncio.gather(
                *(
                    client.submit(f"after the restart {i}", idempotency_key=f"after-{i}", **SMALL)  # type: ignore[arg-type]
                    for i in range(20)
                )
            )
            replay = await client.submit("before the restart", idempotency_key="before", **SMALL)  # type: ignore[arg-type]
        finally:
            await stack.submit.stop(0)  # the stack's fixture stops the first one
    assert all(h.created for h in again) and len({h.task_id for h in again}) == 20
    assert not replay.created and replay.task_id == first.task_id  # idempotency as for unary
    assert _unary_submits() == unary  # all by the new server's stream


class _OldGateway:
    """A gateway of a release without SubmitStream: the real service's SubmitTask, nothing else."""

    def __init__(self, gateway: submit_service.Gateway) -> None:
        self.gateway = gateway
        self.calls = 0

    async def submit(self, request: gateway_pb2.SubmitTaskRequest, context: Any) -> gateway_pb2.SubmitTaskResponse:
        self.calls += 1
        return await self.gateway.SubmitTask(request, context)


@pytest.fixture
async def old_gateway(stack: Stack) -> AsyncIterator[tuple[int, _OldGateway]]:
    old = _OldGateway(stack.submit.gateway)
    server = grpc.aio.server()
    handler = grpc.method_handlers_generic_handler(
        "taskgate.v1.TaskGateway",
        {
            "SubmitTask": grpc.unary_unary_rpc_method_handler(
                old.submit,
                request_deserializer=gateway_pb2.SubmitTaskRequest.FromString,
                response_serializer=gateway_pb2.SubmitTaskResponse.SerializeToString,
            ),
        },
    )
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        yield port, old
    finally:
        await server.stop(0)


async def test_a_server_without_the_stream_is_used_by_unary_submit(
    stack: Stack, old_gateway: tuple[int, _OldGateway]
) -> None:
    port, old = old_gateway
    async with stack.client(address=f"127.0.0.1:{port}") as client:
        handles = await asyncio.gather(*(client.submit(f"old {i}", **SMALL) for i in range(5)))  # type: ignore[arg-type]
        later = await client.submit("later", **SMALL)  # type: ignore[arg-type]
    assert old.calls == 6
    assert all(h.created for h in [*handles, later])
    assert len({h.task_id for h in [*handles, later]}) == 6


async def test_unary_only_when_the_stream_is_turned_off(stack: Stack) -> None:
    unary = _unary_submits()
    async with stack.client(submit_stream=False) as client:
        handle = await client.submit("unary", **SMALL)  # type: ignore[arg-type]
        assert not client._pipes
    assert handle.created and _unary_submits() == unary + 1


async def test_streamed_requests_keep_the_tenant_call_throttle(stack: Stack) -> None:
    """One token of the tenant's call bucket per request, as per unary call: past the burst, requests are refused
    RESOURCE_EXHAUSTED one by one and the stream carries on."""
    settings = stack.settings.model_copy(update={"tenant_calls_per_second": 0.5, "tenant_calls_burst": 5})
    await stack.submit.stop(0)
    stack.submit = await submit_service.start(settings, stack.backends)
    try:
        key, _ = await auth.create_key(
            stack.backends.pool, settings.api_key_pepper, "throttled", submits_per_minute=1000
        )
        async with stack.client(api_key=key) as client:
            answers = await asyncio.gather(
                *(client.submit(f"t {i}", **SMALL) for i in range(8)),  # type: ignore[arg-type]
                return_exceptions=True,
            )
    finally:
        await stack.submit.stop(0)  # the stack's fixture stops the first one
    refused = [a for a in answers if isinstance(a, BaseException)]
    assert refused and all(getattr(a, "reason", "") == reasons.TENANT_RATE_LIMITED for a in refused), answers
    assert 0 < len(answers) - len(refused) < 8
