"""Per-tenant limits on calls and streams: one tenant past its limit is refused with RESOURCE_EXHAUSTED (its reason,
RetryInfo), while another tenant on the same process goes on unhindered."""

from __future__ import annotations

from contextlib import AsyncExitStack
from typing import Any

import grpc
import pytest
from google.rpc import error_details_pb2

from services.notifier.service import start as start_notifier
from taskgate import auth
from taskgate.config import Settings
from taskgate.runtime import Backends
from taskgate_api import reasons
from taskgate_api.v1 import events_pb2, events_pb2_grpc, gateway_pb2, gateway_pb2_grpc
from tests.support.harness import bearer, trailing_details, wait_for


@pytest.fixture
def settings(settings: Settings) -> Settings:
    """A bucket of three calls refilled once in ten seconds; two streams per tenant, three per process."""
    return settings.model_copy(
        update={
            "tenant_calls_per_second": 0.1,
            "tenant_calls_burst": 3,
            "max_streams_per_tenant": 2,
            "max_streams_per_process": 3,
        }
    )


def refusal(exc: grpc.aio.AioRpcError) -> tuple[str, float | None]:
    """The ErrorInfo reason and the RetryInfo delay (seconds) of a refused call."""
    details = trailing_details(exc)
    reason = next(d.reason for d in details if isinstance(d, error_details_pb2.ErrorInfo))
    delays = [
        d.retry_delay.ToTimedelta().total_seconds() for d in details if isinstance(d, error_details_pb2.RetryInfo)
    ]
    return reason, (delays[0] if delays else None)


async def test_a_tenant_past_its_call_rate_is_refused_and_another_tenant_is_not(
    backends: Backends, settings: Settings, stub: gateway_pb2_grpc.TaskGatewayAsyncStub
) -> None:
    greedy, _ = await auth.create_key(backends.pool, settings.api_key_pepper, "greedy")
    quiet, _ = await auth.create_key(backends.pool, settings.api_key_pepper, "quiet")
    for _ in range(3):  # the burst: reads count like writes
        await stub.ListTasks(gateway_pb2.ListTasksRequest(), metadata=bearer(greedy))
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await stub.ListTasks(gateway_pb2.ListTasksRequest(), metadata=bearer(greedy))
    assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    reason, delay = refusal(refused.value)
    # the moment its next call may come: one interval (1 / rate) after the burst, less the time the burst took
    assert reason == reasons.TENANT_RATE_LIMITED and delay == pytest.approx(10.0, abs=0.5)
    with pytest.raises(grpc.aio.AioRpcError) as also_refused:  # another method, the same tenant's bucket
        await stub.GetTask(gateway_pb2.GetTaskRequest(task_id="1"), metadata=bearer(greedy))
    assert also_refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    for _ in range(3):
        answer = await stub.ListTasks(gateway_pb2.ListTasksRequest(), metadata=bearer(quiet))
        assert list(answer.tasks) == []


async def test_open_streams_are_capped_per_tenant_and_per_process_and_a_closed_one_frees_its_place(
    backends: Backends, settings: Settings
) -> None:
    own = settings.model_copy(update={"tenant_calls_per_second": 0.0})  # only the stream caps here
    handle = await start_notifier(own, backends)
    first, _ = await auth.create_key(backends.pool, settings.api_key_pepper, "first")
    second, _ = await auth.create_key(backends.pool, settings.api_key_pepper, "second")
    try:
        async with AsyncExitStack() as stack:
            channel = await stack.enter_async_context(grpc.aio.insecure_channel(f"127.0.0.1:{handle.port}"))
            stub = events_pb2_grpc.TaskEventsStub(channel)

            async def opened(key: str) -> Any:
                call = stub.WatchTasks(events_pb2.WatchTasksRequest(), metadata=bearer(key))
                stack.callback(call.cancel)
                assert (await call.read()).HasField("keepalive")  # caught up: the stream is open and counted
                return call

            async def refused(key: str) -> str:
                call = stub.WatchTasks(events_pb2.WatchTasksRequest(), metadata=bearer(key))
                with pytest.raises(grpc.aio.AioRpcError) as exc:
                    await call.read()
                assert exc.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                reason, delay = refusal(exc.value)
                assert reason == reasons.TOO_MANY_STREAMS and delay is not None
                return exc.value.details() or ""

            held = [await opened(first), await opened(first)]
            assert "tenant" in await refused(first)
            await opened(second)  # another tenant is not held back by the first one's cap
            assert "server" in await refused(second)  # three open: the process's cap
            held[0].cancel()

            async def reopened() -> bool:
                call = stub.WatchTasks(events_pb2.WatchTasksRequest(), metadata=bearer(first))
                stack.callback(call.cancel)
                try:
                    return (await call.read()).HasField("keepalive")
                except grpc.aio.AioRpcError:
                    return False

            await wait_for(reopened, within=5.0)
    finally:
        await handle.stop()
