"""SubmitTasks over real gRPC: one result per item (its task or its own error status), the SDK's submit_many (asyncio
and blocking) and the CLI's `submit --file`."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path

import grpc
import pytest
from google.rpc import error_details_pb2

from services.submit.service import SubmitHandle
from taskgate import auth
from taskgate import bus as busmod
from taskgate.runtime import Backends
from taskgate_api.v1 import gateway_pb2, gateway_pb2_grpc
from taskgate_client import (
    AlreadyExists,
    InvalidArgument,
    ResourceExhausted,
    SubmitItem,
    TaskgateError,
    connect,
    connect_async,
)
from tests.support.factories import key_for
from tests.support.harness import details_of, wait_for

SMALL: SubmitItem = {"frames": 9, "width": 32, "height": 32, "steps": 2}


async def test_each_item_gets_its_own_result_in_order(gateway: SubmitHandle, backends: Backends) -> None:
    key, _ = await auth.create_key(backends.pool, backends.settings.api_key_pepper, "tenant-a", max_pending=4,
                                   max_priority=10)
    items: list[SubmitItem] = [
        {"prompt": "one", "idempotency_key": "k1", **SMALL},
        {"prompt": "", **SMALL},                                    # invalid: refused alone
        {"prompt": "one", "idempotency_key": "k1", **SMALL},        # the same request again: the same task
        {"prompt": "not one", "idempotency_key": "k1", **SMALL},    # the key of another request
        {"prompt": "two", "priority": "high", **SMALL},
        {"prompt": "three", "model": "sleepy", **SMALL},
        {"prompt": "four", **SMALL},
        {"prompt": "five", **SMALL},                                # the tenant's fifth: over max_pending
    ]
    progress: list[tuple[int, int]] = []
    async def all_queued() -> bool:
        return [r[0] for r in await backends.pool.fetch("SELECT DISTINCT status::text FROM task")] == ["QUEUED"]

    async with connect_async(f"127.0.0.1:{gateway.port}", key) as client:
        results = await client.submit_many(items, chunk_size=3, on_progress=lambda d, t: progress.append((d, t)))
        await wait_for(all_queued)  # each answer followed its admission commit; the dispatcher queued them after
        high_position = (await client.get_with_interval(results[4].task_id))[0].queue_position  # type: ignore[union-attr]
    assert progress == [(3, 8), (6, 8), (8, 8)]
    kinds = [type(r).__name__ if isinstance(r, TaskgateError) else r.status.value for r in results]
    assert kinds == ["CREATED", "InvalidArgument", "CREATED", "AlreadyExists", "CREATED", "CREATED", "CREATED",
                     "ResourceExhausted"]
    first, bad, again, reused, high, _, _, over = results
    assert isinstance(bad, InvalidArgument) and [v.field for v in bad.field_violations] == ["prompt"]
    assert not isinstance(first, TaskgateError) and not isinstance(again, TaskgateError)
    assert first.created and not again.created and again.task_id == first.task_id
    assert isinstance(reused, AlreadyExists) and reused.metadata["task_id"] == first.task_id
    assert isinstance(over, ResourceExhausted) and over.reason == "TOO_MANY_PENDING_TASKS"
    assert not isinstance(high, TaskgateError) and high_position == 1
    assert await backends.pool.fetchval("SELECT count(*) FROM task") == 4
    assert (await backends.bus.js.stream_info(busmod.TASKS_STREAM)).state.messages == 4


async def test_the_call_itself_takes_1_to_1000_items(gateway: SubmitHandle, backends: Backends) -> None:
    md = await key_for(backends)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{gateway.port}") as channel:
        stub = gateway_pb2_grpc.TaskGatewayStub(channel)
        for count in (0, 1001):
            request = gateway_pb2.SubmitTasksRequest(
                requests=[gateway_pb2.SubmitTaskRequest(prompt=f"p{i}") for i in range(count)])
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await stub.SubmitTasks(request, metadata=md, timeout=10)
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        # an item's error carries the details SubmitTask would send: here the rate limit's RetryInfo
        limited = await key_for(backends, "tenant-r", submits_per_minute=1)
        request = gateway_pb2.SubmitTasksRequest(requests=[gateway_pb2.SubmitTaskRequest(prompt="a"),
                                                           gateway_pb2.SubmitTaskRequest(prompt="b")])
        response = await stub.SubmitTasks(request, metadata=limited, timeout=10)
    ok, refused_item = response.results
    assert ok.HasField("response") and ok.response.created
    assert refused_item.error.code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
    details = details_of(refused_item.error)
    assert any(isinstance(d, error_details_pb2.RetryInfo) for d in details)


async def test_blocking_submit_many(gateway: SubmitHandle, backends: Backends) -> None:
    key, _ = await auth.create_key(backends.pool, backends.settings.api_key_pepper, "tenant-a")

    def session() -> list[str]:
        with connect(f"127.0.0.1:{gateway.port}", key) as client:
            results = client.submit_many([{"prompt": f"p{i}", **SMALL} for i in range(3)])
            return [r.code_name if isinstance(r, TaskgateError) else r.refresh().status.value for r in results]

    assert await asyncio.to_thread(session) == ["QUEUED"] * 3


async def test_cli_submits_a_jsonl_file(gateway: SubmitHandle, backends: Backends, tmp_path: Path) -> None:
    key, _ = await auth.create_key(backends.pool, backends.settings.api_key_pepper, "tenant-a", max_pending=20)
    tasks = tmp_path / "tasks.jsonl"
    lines = [{"prompt": f"fox {i}", **SMALL} for i in range(5)] + [{"prompt": "too big", "frames": 100000}]
    tasks.write_text("\n".join(json.dumps(line) for line in lines) + "\n\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("TASKGATE_")} | {
        "TASKGATE_ADDRESS": f"127.0.0.1:{gateway.port}", "TASKGATE_API_KEY": key,
        "TASKGATE_STATE_DIR": str(tmp_path / "state"),
    }

    async def cli(*args: str) -> tuple[int, str, str]:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "taskgate_client.cli", *args, env=env, cwd=tmp_path,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        )
        out, err = await asyncio.wait_for(proc.communicate(), 60)
        assert proc.returncode is not None
        return proc.returncode, out.decode(), err.decode()

    code, out, err = await cli("submit", "--file", str(tasks), "--json")
    results = [json.loads(line) for line in out.splitlines()]
    assert code == 1 and [r["index"] for r in results] == list(range(6))
    assert all(r["task"]["status"] == "CREATED" and r["task"]["created"] for r in results[:5])
    assert results[5]["error"]["code"] == "INVALID_ARGUMENT"
    assert err == ""  # --json with stderr not a terminal: no progress bar
    code, out, err = await cli("submit", "--file", str(tasks))  # lines without a key get fresh ones: five new tasks
    assert code == 1 and len(out.splitlines()) == 6 and out.splitlines()[0].split("\t")[3] == "created"
    assert "6/6" in err and "1 of 6 refused" in err  # the progress bar and the tally, on stderr
    (tmp_path / "bad.jsonl").write_text('{"prompt": "x", "colour": "red"}\n')
    code, _, err = await cli("submit", "--file", str(tmp_path / "bad.jsonl"))
    assert code == 2 and "unknown key 'colour'" in err
    assert await backends.pool.fetchval("SELECT count(*) FROM task") == 10
