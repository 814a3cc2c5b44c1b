"""SubmitStream on the wire: each request admitted as SubmitTask admits it (its key, its deadline, its own error), the
stream's end after its age or a drain with every request it read answered, and a revoked key ending it."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import grpc
from google.protobuf.duration_pb2 import Duration
from google.rpc import error_details_pb2

from services.submit.service import SubmitHandle, start
from taskgate.config import Settings
from taskgate.runtime import Backends
from taskgate.store import get_task, tenants
from taskgate_api.v1 import gateway_pb2, gateway_pb2_grpc
from tests.support.factories import key_for
from tests.support.harness import details_of

SMALL = {"params": {"num_frames": 9, "width": 32, "height": 32, "num_inference_steps": 2}}


def item(
    rid: int, prompt: str = "a fox", timeout: float | None = None, **fields: Any
) -> gateway_pb2.SubmitStreamRequest:
    msg = gateway_pb2.SubmitStreamRequest(
        request_id=rid,
        request=gateway_pb2.SubmitTaskRequest(prompt=prompt, **{"idempotency_key": f"k{rid}", **SMALL, **fields}),
    )
    if timeout is not None:
        d = Duration()
        d.FromNanoseconds(int(timeout * 1e9))
        msg.timeout.CopyFrom(d)
    return msg


class Sender:
    """One SubmitStream call fed from a queue."""

    def __init__(self, stub: Any, md: Any) -> None:
        self.queue: asyncio.Queue[gateway_pb2.SubmitStreamRequest | None] = asyncio.Queue()
        self.call = stub.SubmitStream(self._requests(), metadata=md)

    async def _requests(self) -> AsyncIterator[gateway_pb2.SubmitStreamRequest]:
        while (msg := await self.queue.get()) is not None:
            yield msg

    def send(self, *msgs: gateway_pb2.SubmitStreamRequest) -> None:
        for msg in msgs:
            self.queue.put_nowait(msg)

    def done_writing(self) -> None:
        self.queue.put_nowait(None)

    async def answers(self, n: int) -> dict[int, gateway_pb2.SubmitTaskResult]:
        got: dict[int, gateway_pb2.SubmitTaskResult] = {}
        while len(got) < n:
            msg = await asyncio.wait_for(self.call.read(), 10)
            assert msg is not grpc.aio.EOF
            got[msg.request_id] = msg.result
        return got


async def test_each_request_is_admitted_on_its_own_and_answered_by_its_id(
    gateway: SubmitHandle, stub: gateway_pb2_grpc.TaskGatewayAsyncStub, backends: Backends
) -> None:
    md = await key_for(backends, max_pending=100, submits_per_minute=1000)
    sender = Sender(stub, md)
    await sender.call.initial_metadata()  # the server accepted the stream before any request
    sender.send(
        item(7, "seven"),
        item(3, "three", model_id="no-such-model"),
        item(9, "nine", timeout=0.001),  # less time than a submission needs: refused before it joins a batch
        item(11, "seven", idempotency_key="k7"),  # the same key and request as 7: its task again
    )
    got = await sender.answers(4)
    # 7 and 11 are admitted concurrently (the stream pipelines them): one creates the task, the other finds it
    assert got[7].HasField("response") and got[11].HasField("response")
    assert sorted([got[7].response.created, got[11].response.created]) == [False, True]
    assert got[11].response.task.id == got[7].response.task.id
    row = await get_task(backends.pool, int(got[7].response.task.id))
    assert row is not None and row.prompt == "seven"
    assert got[3].error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    violations = [d for d in details_of(got[3].error) if isinstance(d, error_details_pb2.BadRequest)]
    assert [v.field for v in violations[0].field_violations] == ["model_id"]
    assert got[9].error.code == grpc.StatusCode.DEADLINE_EXCEEDED.value[0], got[9]
    assert "admitted nothing" in got[9].error.message
    sender.send(item(12, "after the refusals"))  # the stream goes on
    assert (await sender.answers(1))[12].response.created
    sender.done_writing()
    assert await sender.call.read() is grpc.aio.EOF
    assert await sender.call.code() is grpc.StatusCode.OK


async def test_an_unknown_key_is_refused_before_any_request(
    gateway: SubmitHandle, stub: gateway_pb2_grpc.TaskGatewayAsyncStub
) -> None:
    sender = Sender(stub, (("authorization", "Bearer tg_not_a_key"),))
    await sender.call.initial_metadata()
    assert await sender.call.code() is grpc.StatusCode.UNAUTHENTICATED


async def test_a_revoked_key_ends_its_stream(
    settings: Settings, backends: Backends, stub: gateway_pb2_grpc.TaskGatewayAsyncStub, gateway: SubmitHandle
) -> None:
    md = await key_for(backends, max_pending=100, submits_per_minute=1000)
    sender = Sender(stub, md)
    sender.send(item(1))
    assert (await sender.answers(1))[1].response.created
    key = md[0][1].removeprefix("Bearer ")
    assert await tenants.revoke_api_keys(backends.pool, key[:10])
    code = await asyncio.wait_for(sender.call.code(), 10)
    assert code is grpc.StatusCode.UNAUTHENTICATED and "revoked" in (await sender.call.details() or "")


async def test_a_stream_ends_at_its_age_having_answered_what_it_read(settings: Settings, backends: Backends) -> None:
    handle = await start(settings.model_copy(update={"stream_max_age_seconds": 0.5}), backends)
    try:
        md = await key_for(backends, max_pending=100, submits_per_minute=1000)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{handle.port}") as channel:
            sender = Sender(gateway_pb2_grpc.TaskGatewayStub(channel), md)
            sender.send(*(item(i) for i in range(1, 6)))
            got = await sender.answers(5)
            assert all(r.response.created for r in got.values())
            assert await asyncio.wait_for(sender.call.read(), 5) is grpc.aio.EOF  # ended by its age, not by us
            assert await sender.call.code() is grpc.StatusCode.OK
    finally:
        await handle.stop(0)


async def test_a_draining_gateway_ends_its_streams(settings: Settings, backends: Backends) -> None:
    handle = await start(settings, backends)
    try:
        md = await key_for(backends, max_pending=100, submits_per_minute=1000)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{handle.port}") as channel:
            sender = Sender(gateway_pb2_grpc.TaskGatewayStub(channel), md)
            sender.send(item(1))
            assert (await sender.answers(1))[1].response.created
            stopping = asyncio.create_task(handle.stop(30))
            assert await asyncio.wait_for(sender.call.read(), 5) is grpc.aio.EOF
            assert await sender.call.code() is grpc.StatusCode.OK
            await asyncio.wait_for(stopping, 10)  # the stream's end let the stop finish long before its grace
    finally:
        await handle.stop(0)
