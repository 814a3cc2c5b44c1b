"""Files and batches on the gateway (#36): a JSONL input stored and read back; every line submitted as one task,
refusals in the error file, the counts following the tasks, the output and error files written when they finished; an
ingest stopped halfway (its gateway stopped between submitting a chunk and recording it) resumed by the next read of
the batch, creating each line's task exactly once."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest

from services.submit import service as submit_service
from services.submit.batches import BatchSignals
from taskgate.config import ModelSpec, Settings
from taskgate.runtime import Backends
from taskgate_api.v1 import batches_pb2, gateway_pb2_grpc
from tests.support.factories import key_for
from tests.support.harness import outcome, wait_for

SMALL = {"num_frames": 9, "width": 32, "height": 32, "num_inference_steps": 2}


@pytest.fixture
def settings(settings: Settings) -> Settings:
    models = {**settings.models, "sleepy": ModelSpec(kind="sleep", sleep_seconds=0.05), "held": ModelSpec(kind="sleep")}
    return settings.model_copy(update={"models": models, "default_model": "sleepy", "batch_chunk_lines": 10,
                                       "batch_lease_seconds": 1.0, "submits_per_minute": 100_000})


def jsonl(lines: list[Any]) -> bytes:
    return b"".join((line if isinstance(line, bytes) else json.dumps(line).encode()) + b"\n" for line in lines)


async def upload(stub: Any, md: Any, data: bytes) -> batches_pb2.StoredFile:
    async def parts() -> AsyncIterator[batches_pb2.UploadFileRequest]:
        yield batches_pb2.UploadFileRequest(filename="in.jsonl", purpose="batch", data=data[:100])
        yield batches_pb2.UploadFileRequest(data=data[100:])

    stored: batches_pb2.StoredFile = await stub.UploadFile(parts(), metadata=md, timeout=10)
    return stored


async def content(stub: Any, md: Any, file_id: str) -> bytes:
    got = b""
    async for chunk in stub.GetFileContent(batches_pb2.GetFileRequest(file_id=file_id), metadata=md, timeout=10):
        got += chunk.data
    return got


async def test_a_batch_runs_every_line_and_writes_its_output_and_error_files(
    stub: Any, backends: Backends, settings: Settings, workers: Any
) -> None:
    md = await key_for(backends, max_pending=100)
    lines: list[Any] = [{"custom_id": f"c{i}", "request": {"prompt": f"fox {i}", "params": SMALL}} for i in range(25)]
    lines[3] = b"{not json"
    lines[7] = {"custom_id": "c7", "request": {"prompt": " ", "params": SMALL}}  # the gateway refuses it
    lines[9] = {"custom_id": "c9", "error": {"code": "invalid_body", "message": "refused upstream"}}
    data = jsonl(lines)
    stored = await upload(stub, md, data)
    assert stored.id.startswith("file-") and stored.size_bytes == len(data) and stored.purpose == "batch"
    assert await content(stub, md, stored.id) == data
    assert (
        await stub.GetFile(batches_pb2.GetFileRequest(file_id=stored.id), metadata=md, timeout=5)
    ).sha256 == stored.sha256
    listed = await stub.ListFiles(batches_pb2.ListFilesRequest(purpose="batch"), metadata=md, timeout=5)
    assert [f.id for f in listed.files] == [stored.id]
    other = await key_for(backends, tenant="tenant-other", max_pending=10)
    code, _, _ = await outcome(stub.GetFile(batches_pb2.GetFileRequest(file_id=stored.id), metadata=other, timeout=5))
    assert code is grpc.StatusCode.NOT_FOUND  # another tenant's file is nobody's

    await workers(settings, worker_models=["sleepy"])
    batch = await stub.CreateBatch(batches_pb2.CreateBatchRequest(
        input_file_id=stored.id, endpoint="/v1/responses", completion_window="24h", window_seconds=86400,
        metadata={"run": "nightly"},
    ), metadata=md, timeout=5)
    assert batch.id.startswith("batch_") and batch.status == "validating"

    async def ended() -> bool:
        got = await stub.GetBatch(batches_pb2.GetBatchRequest(batch_id=batch.id), metadata=md, timeout=5)
        return got.status == "completed"

    await wait_for(ended, within=60)
    done = await stub.GetBatch(batches_pb2.GetBatchRequest(batch_id=batch.id), metadata=md, timeout=5)
    assert (done.counts.total, done.counts.completed, done.counts.failed) == (25, 22, 3)
    assert done.metadata["run"] == "nightly" and done.completed_at.seconds > 0
    output = [json.loads(line) for line in (await content(stub, md, done.output_file_id)).splitlines()]
    assert sorted(line["custom_id"] for line in output) == sorted(f"c{i}" for i in range(25) if i not in (3, 7, 9))
    assert {line["task"]["status"] for line in output} == {"TASK_STATUS_SUCCEEDED"}
    assert all(line["task"]["metadata"]["batch_id"] == batch.id for line in output)
    failed = {line["custom_id"]: line for line in
              (json.loads(raw) for raw in (await content(stub, md, done.error_file_id)).splitlines())}
    assert set(failed) == {"line-3", "c7", "c9"}
    assert failed["c7"]["error"]["code"] == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert failed["c9"]["error"]["message"] == "refused upstream" and "not JSON" in failed["line-3"]["error"]["message"]
    info = await stub.GetFile(batches_pb2.GetFileRequest(file_id=done.output_file_id), metadata=md, timeout=5)
    assert info.purpose == "batch_output" and info.batch_id == batch.id
    rows = await backends.pool.fetchval("SELECT count(*) FROM task WHERE metadata->>'batch_id' = $1", batch.id)
    assert rows == 22


async def test_an_ingest_stopped_halfway_resumes_and_creates_each_task_once(
    backends: Backends, settings: Settings
) -> None:
    md = await key_for(backends, max_pending=100)
    held_at = asyncio.Event()

    async def hold(_batch: int, start: int) -> None:
        if start == 20:  # the third chunk is submitted, not recorded: the gateway stops here
            held_at.set()
            await asyncio.Event().wait()

    first = await submit_service.start(settings, backends, batch_signals=BatchSignals(submitted=hold))
    lines = [
        {"custom_id": f"c{i}", "request": {"prompt": f"cat {i}", "model_id": "held", "params": SMALL}}
        for i in range(45)
    ]
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{first.port}") as channel:
            stub = gateway_pb2_grpc.TaskGatewayStub(channel)
            stored = await upload(stub, md, jsonl(lines))
            batch = await stub.CreateBatch(batches_pb2.CreateBatchRequest(
                input_file_id=stored.id, endpoint="/v1/responses", completion_window="24h", window_seconds=3600,
            ), metadata=md, timeout=5)
            await asyncio.wait_for(held_at.wait(), 30)
    finally:
        await first.stop(0)
    count = "SELECT count(*) FROM task WHERE metadata->>'batch_id' = $1"
    assert await backends.pool.fetchval(count, batch.id) == 30  # three chunks submitted, two recorded
    assert await backends.pool.fetchval("SELECT ingested_lines FROM task_batch") == 20

    second = await submit_service.start(settings, backends)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{second.port}") as channel:
            stub = gateway_pb2_grpc.TaskGatewayStub(channel)

            async def ingested() -> bool:  # each read tries the lapsed lease; one resumes the ingest
                got = await stub.GetBatch(batches_pb2.GetBatchRequest(batch_id=batch.id), metadata=md, timeout=5)
                return got.status == "in_progress"

            await wait_for(ingested, within=30)
            got = await stub.GetBatch(batches_pb2.GetBatchRequest(batch_id=batch.id), metadata=md, timeout=5)
            assert got.counts.total == 45 and got.counts.failed == 0
            cancelled = await stub.CancelBatch(
                batches_pb2.CancelBatchRequest(batch_id=batch.id), metadata=md, timeout=5
            )
            assert cancelled.status in ("cancelling", "cancelled")

            async def ended() -> bool:
                now = await stub.GetBatch(batches_pb2.GetBatchRequest(batch_id=batch.id), metadata=md, timeout=5)
                return now.status == "cancelled"

            await wait_for(ended, within=30)
            final = await stub.GetBatch(batches_pb2.GetBatchRequest(batch_id=batch.id), metadata=md, timeout=5)
            assert final.counts.failed == 45 and final.error_file_id and not final.output_file_id
    finally:
        await second.stop(0)
    per_line = await backends.pool.fetch(
        "SELECT metadata->>'custom_id' AS c, count(*) AS n FROM task WHERE metadata->>'batch_id' = $1 GROUP BY 1",
        batch.id,
    )
    assert len(per_line) == 45 and {r["n"] for r in per_line} == {1}  # every line's task, once
    assert await backends.pool.fetchval("SELECT count(*) FROM batch_item WHERE task_id IS NOT NULL") == 45
    statuses = await backends.pool.fetch(
        "SELECT DISTINCT status::text FROM task WHERE metadata->>'batch_id' = $1", batch.id
    )
    assert [r["status"] for r in statuses] == ["CANCELED"]
