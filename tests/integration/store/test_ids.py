"""Task ids that cannot collide between processes: leased node numbers, and a retryable answer to any unique-key
race."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import pytest
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from services.submit.service import SubmitHandle
from taskgate import ids
from taskgate.config import Settings
from taskgate.runtime import Backends
from taskgate_api.v1 import gateway_pb2, gateway_pb2_grpc
from taskgate_client import AsyncTaskgateClient, ClientConfig
from tests.support import factories
from tests.support.harness import Cluster, details_of, wait_for


async def _holders(backends: Backends) -> dict[int, str]:
    rows = await backends.pool.fetch("SELECT node, holder FROM id_node_lease WHERE holder IS NOT NULL")
    return {r["node"]: r["holder"] for r in rows}


async def test_live_processes_hold_distinct_numbers_renewed_and_released(backends: Backends) -> None:
    leased = [ids.LeasedIds(backends.pool, lease_seconds=60) for _ in range(20)]
    await asyncio.gather(*(lease.start() for lease in leased))
    try:
        nodes = {lease.node for lease in leased}
        assert len(nodes) == 20 and set(await _holders(backends)) == nodes
        made = [lease.next() for lease in leased for _ in range(100)]
        assert len(set(made)) == len(made)
    finally:
        await asyncio.gather(*(lease.close() for lease in leased))
    assert await _holders(backends) == {}
    again = ids.LeasedIds(backends.pool, lease_seconds=60)
    await again.start()
    try:
        assert again.node not in nodes  # a released number rests while never-used ones are free
    finally:
        await again.close()


async def test_a_number_taken_by_another_holder_is_replaced(backends: Backends) -> None:
    lease = ids.LeasedIds(backends.pool, lease_seconds=1)  # renewed every 0.25 s
    await lease.start()
    try:
        first = lease.node
        await backends.pool.execute("UPDATE id_node_lease SET holder = 'someone else' WHERE node = $1", first)
        await wait_for(lambda: lease.node != first, within=10)
        assert (await _holders(backends))[lease.node or 0] != "someone else"
        assert (lease.next() >> 12) & 1023 == lease.node
    finally:
        await lease.close()


async def test_no_free_number_refuses_to_start(backends: Backends) -> None:
    await backends.pool.execute("UPDATE id_node_lease SET holder = 'busy', expires_at = now() + interval '1 hour'")
    with pytest.raises(ids.NoFreeNode):
        await ids.LeasedIds(backends.pool, lease_seconds=60).start()


async def test_an_id_collision_answers_aborted_with_retry_info_and_the_sdk_retries(
    gateway: SubmitHandle, backends: Backends, monkeypatch: pytest.MonkeyPatch
) -> None:
    metadata = await factories.key_for(backends)
    taken = (await factories.insert_task(backends.pool)).id
    fresh = gateway.gateway.ids.next
    monkeypatch.setattr(gateway.gateway.ids, "next", lambda: taken)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{gateway.port}") as channel:
        stub = gateway_pb2_grpc.TaskGatewayStub(channel)
        request = gateway_pb2.SubmitTaskRequest(model_id="sleepy", prompt="p", idempotency_key="collides")
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.SubmitTask(request, metadata=metadata, timeout=10)
    assert info.value.code() == grpc.StatusCode.ABORTED
    status = rpc_status.from_call(info.value)
    assert status is not None
    details = details_of(status)
    assert any(isinstance(d, error_details_pb2.RetryInfo) for d in details)
    assert any(isinstance(d, error_details_pb2.ErrorInfo) and d.reason == "CONFLICT" for d in details)

    answers = iter([taken])
    monkeypatch.setattr(gateway.gateway.ids, "next", lambda: next(answers, None) or fresh())
    key = metadata[0][1].removeprefix("Bearer ")
    async with AsyncTaskgateClient(ClientConfig(address=f"127.0.0.1:{gateway.port}", api_key=key)) as client:
        task = await client.submit("p", "sleepy", idempotency_key="collides")
        assert client.retries == 1 and task.created and int(task.task_id) != taken


async def test_processes_forced_onto_one_node_lose_no_task_and_answer_no_internal(
    settings: Settings, backends: Backends, tmp_path: Path
) -> None:
    """Four submit processes share node number 7 (as random numbers could): ids of one millisecond collide."""
    metadata = await factories.key_for(backends, max_pending=1_000_000, submits_per_minute=1_000_000)
    key = metadata[0][1].removeprefix("Bearer ")
    cluster = Cluster(tmp_path, settings.model_copy(update={"id_node": 7}))
    replicas = [cluster.add(f"submit-{i}", "services.submit") for i in range(4)]
    try:
        await cluster.start()
        clients = [
            AsyncTaskgateClient(ClientConfig(address=r.address, api_key=key, retry_attempts=20, retry_max_delay=0.2))
            for r in replicas
        ]
        try:
            made: list[str] = []
            for burst in range(10):  # each burst: every process creates ids within the same few milliseconds
                tasks = await asyncio.gather(*(
                    c.submit("p", "sleepy", idempotency_key=f"b{burst}-c{i}-{n}")
                    for i, c in enumerate(clients) for n in range(10)
                ))
                assert all(t.created for t in tasks)
                made += [t.task_id for t in tasks]
            retried = sum(c.retries for c in clients)
        finally:
            await asyncio.gather(*(c.close() for c in clients))
    finally:
        cluster.stop()
    rows = await backends.pool.fetch("SELECT id FROM task WHERE idempotency_key LIKE 'b%'")
    assert sorted(str(r["id"]) for r in rows) == sorted(made) and len(set(made)) == 400
    logs = "".join(r.log_path.read_text() for r in replicas)
    assert "unhandled error" not in logs
    assert logs.count('"write conflict"') <= retried  # each collision was answered ABORTED, then retried
