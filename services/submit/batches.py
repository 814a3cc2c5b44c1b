"""Files and batches of the gateway: a tenant's files in the result store, and batches that submit every line of an
input file as one task.

A batch's ingest reads its input, then submits it chunk by chunk through the gateway's one submission path (what
SubmitTasks does for a call of that many: every rule, limit and budget applies), each line under the idempotency key
`batch_<id>:<custom_id>`; each chunk's tasks (or refusals) are recorded with the ingest's progress in one guarded
statement. An ingest that dies (its process stopped, its lease lapsed) is resumed by the next read of the batch from
the first line not recorded: the lines of a chunk it submitted but never recorded answer with their existing tasks, so
every line becomes one task, once. Refusals that pass (a rate limit, the pending limit, a backend away) are waited out
and the chunk is sent again; any other refusal is the line's error.

When every line is recorded and every task finished, one reader of the batch takes its finalizing lease and writes its
two files: the output (each SUCCEEDED task, its full text for a chat task) and the errors (refused lines, tasks that
failed, timed out or were canceled), both JSONL in taskgate's own shapes (the HTTP face translates them).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from google.protobuf import json_format

from taskgate import errors
from taskgate.auth import Principal
from taskgate.config import GatewaySettings
from taskgate.model import TaskRow
from taskgate.results import ResultNotFound, ResultStore
from taskgate.states import Status
from taskgate.store import batches as store
from taskgate.store.batches import BatchRow, FileRow
from taskgate.store.pool import Conn
from taskgate_api import reasons
from taskgate_api.v1 import batches_pb2, gateway_pb2

from .batchwire import (
    BATCH_PREFIX,
    Line,
    batch_id,
    batch_proto,
    file_id,
    file_proto,
    jsonl_lines,
    parse_line,
    passing,
    refusal,
)

log = logging.getLogger("taskgate.submit.batches")

PURPOSES = ("batch",)  # what a caller may upload; batch_output and batch_error are written here

Submit = Callable[[Principal, list[gateway_pb2.SubmitTaskRequest]], Awaitable[list[Any]]]
CancelTask = Callable[[int], Awaitable[None]]


@dataclass
class BatchSignals:
    """What tests await or hold in a batch's ingest (None in production)."""

    # awaited after a chunk's submission, before it is recorded (a test holds an ingest there and stops the gateway)
    submitted: Callable[[int, int], Awaitable[None]] | None = None


@dataclass
class Batches:
    """Files and batches over one gateway's pool, result store and submission path."""

    pool: Conn
    results: ResultStore
    settings: GatewaySettings
    next_id: Callable[[], int]
    submit: Submit
    cancel_task: CancelTask
    text_of: Callable[[TaskRow], Awaitable[str | None]]
    signals: BatchSignals = field(default_factory=BatchSignals)
    running: set[asyncio.Task[None]] = field(default_factory=set)

    # -- files ---------------------------------------------------------------------------------------------------

    async def upload(self, tenant: str, parts: AsyncIterator[batches_pb2.UploadFileRequest]) -> batches_pb2.StoredFile:
        """Stores a file sent in parts (its name and purpose on the first) and records it."""
        cap = self.settings.file_max_bytes
        received = bytearray()
        filename = purpose = ""
        first = True
        async for part in parts:
            if first:
                filename, purpose, first = part.filename, part.purpose, False
            received += part.data
            if len(received) > cap:
                raise errors.invalid_argument([("data", f"larger than {cap} bytes")])
        bad: list[tuple[str, str]] = []
        if purpose not in PURPOSES:
            bad.append(("purpose", f"must be one of {', '.join(PURPOSES)}"))
        if not filename or len(filename) > 256 or not filename.isprintable():
            bad.append(("filename", "must be 1 to 256 printable characters"))
        if not received.strip():
            bad.append(("data", "empty"))
        if bad:
            raise errors.invalid_argument(bad)
        data = bytes(received)
        new_id = self.next_id()
        stored = await self.results.put(f"file-{new_id}", data, "application/jsonl")
        row = await store.insert_file(
            self.pool, new_id, tenant, purpose, filename, stored.uri, len(data), hashlib.sha256(data).hexdigest()
        )
        return file_proto(row)

    async def file(self, tenant: str, text_id: str) -> FileRow:
        row = await store.get_file(self.pool, tenant, file_id(text_id))
        if row is None:
            raise errors.not_found("file")
        return row

    async def files(self, tenant: str, request: batches_pb2.ListFilesRequest) -> batches_pb2.ListFilesResponse:
        size = request.page_size or 20
        if not 1 <= size <= 100:
            raise errors.invalid_argument([("page_size", "must be between 1 and 100")])
        after = file_id(request.after, "after") if request.after else None
        rows = await store.list_files(self.pool, tenant, request.purpose, after, size + 1)
        return batches_pb2.ListFilesResponse(files=[file_proto(r) for r in rows[:size]], has_more=len(rows) > size)

    async def content(self, tenant: str, text_id: str) -> AsyncIterator[batches_pb2.FileChunk]:
        row = await self.file(tenant, text_id)
        first = True
        try:
            async for data in self.results.read(row.uri):
                chunk = batches_pb2.FileChunk(data=data)
                if first:
                    chunk.info.CopyFrom(file_proto(row))
                    first = False
                yield chunk
        except ResultNotFound:
            raise errors.not_found("file content") from None
        if first:
            yield batches_pb2.FileChunk(info=file_proto(row))

    async def _read(self, row: FileRow) -> bytes:
        got = bytearray()
        async for data in self.results.read(row.uri):
            got += data
        return bytes(got)

    # -- batches -------------------------------------------------------------------------------------------------

    async def create(self, who: Principal, request: batches_pb2.CreateBatchRequest) -> batches_pb2.Batch:
        bad: list[tuple[str, str]] = []
        if not request.endpoint:
            bad.append(("endpoint", "required"))
        if not 0 < request.window_seconds <= self.settings.batch_max_window_seconds:
            bad.append(("window_seconds", f"must be above 0 and at most {self.settings.batch_max_window_seconds:g}"))
        if len(request.metadata) > 16:
            bad.append(("metadata", "at most 16 pairs"))
        if bad:
            raise errors.invalid_argument(bad)
        source = await self.file(who.tenant_id, request.input_file_id)
        if source.purpose != "batch":
            raise errors.invalid_argument([("input_file_id", f"a file of purpose {source.purpose!r}, not 'batch'")])
        original = None
        if request.source_file_id:
            original = (await self.file(who.tenant_id, request.source_file_id)).id
        row = await store.insert_batch(
            self.pool,
            self.next_id(),
            who.tenant_id,
            request.end_user,
            source.id,
            request.endpoint,
            request.completion_window,
            dict(request.metadata),
            request.window_seconds,
            self.settings.batch_lease_seconds,
            original,
        )
        self._start(self._ingest(who, row))
        return batch_proto(row)

    async def get(self, who: Principal, text_id: str) -> batches_pb2.Batch:
        row = await store.get_batch(self.pool, who.tenant_id, batch_id(text_id))
        if row is None:
            raise errors.not_found("batch")
        return batch_proto(await self._advance(who, row))

    async def listing(self, who: Principal, request: batches_pb2.ListBatchesRequest) -> batches_pb2.ListBatchesResponse:
        size = request.page_size or 20
        if not 1 <= size <= 100:
            raise errors.invalid_argument([("page_size", "must be between 1 and 100")])
        after = batch_id(request.after) if request.after else None
        rows = await store.list_batches(self.pool, who.tenant_id, after, size + 1)
        shown = [batch_proto(await self._advance(who, r)) for r in rows[:size]]
        return batches_pb2.ListBatchesResponse(batches=shown, has_more=len(rows) > size)

    async def cancel(self, who: Principal, text_id: str) -> batches_pb2.Batch:
        number = batch_id(text_id)
        moved = await store.cancel(self.pool, who.tenant_id, number)
        if moved is None:
            row = await store.get_batch(self.pool, who.tenant_id, number)
            if row is None:
                raise errors.not_found("batch")
            if row.status in ("cancelling", "cancelled"):
                return batch_proto(row)
            raise errors.failed_precondition(
                reasons.TASK_FINISHED, f"the batch already ended as {row.status}", status=row.status
            )
        await self._cancel_tasks(moved.id)
        row = await store.get_batch(self.pool, who.tenant_id, number)
        assert row is not None
        return batch_proto(await self._advance(who, row))

    async def _cancel_tasks(self, number: int) -> None:
        for task_id in await store.unfinished_tasks(self.pool, number):
            await self.cancel_task(task_id)

    async def _advance(self, who: Principal, row: BatchRow) -> BatchRow:
        """Moves a batch on as far as a read may: resumes an ingest whose holder died, and writes the files of a batch
        whose tasks all finished (the answer is the batch after that)."""
        if row.status == "validating":
            taken = await store.take_lease(self.pool, row.id, self.settings.batch_lease_seconds)
            if taken is not None:
                log.info("batch ingest resumed", extra={"batch_id": row.id, "from_line": taken.ingested_lines})
                self._start(self._ingest(who, taken))
            return row
        if row.status in ("in_progress", "cancelling") and row.unfinished == 0:
            taken = await store.finalize(self.pool, row, self.settings.batch_lease_seconds)
            if taken is not None:
                await self._write_files(taken)
        elif row.status == "finalizing":
            taken = await store.take_lease(self.pool, row.id, self.settings.batch_lease_seconds)
            if taken is not None:
                await self._write_files(taken)
        else:
            return row
        again = await store.get_batch(self.pool, who.tenant_id, row.id)
        assert again is not None
        return again

    def _start(self, work: Awaitable[None]) -> None:
        task = asyncio.ensure_future(work)
        self.running.add(task)
        task.add_done_callback(self.running.discard)

    async def close(self) -> None:
        """Stops the ingests running here (their lease lapses; the next read of each batch resumes it)."""
        for task in list(self.running):
            task.cancel()
        for task in list(self.running):
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task

    async def _ingest(self, who: Principal, row: BatchRow) -> None:
        try:
            await self._ingest_lines(who, row)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("batch ingest stopped; the next read of the batch resumes it", extra={"batch_id": row.id})

    async def _ingest_lines(self, who: Principal, row: BatchRow) -> None:
        source = await store.get_file(self.pool, row.user_id, row.input_file_id)
        if source is None:
            await store.fail(self.pool, row.id, "the input file is gone")
            return
        lines = jsonl_lines(await self._read(source))
        if not lines:
            await store.fail(self.pool, row.id, "the input file holds no lines")
            return
        if len(lines) > self.settings.batch_max_lines:
            await store.fail(self.pool, row.id, f"the input file holds more than {self.settings.batch_max_lines} lines")
            return
        await store.set_total(self.pool, row.id, len(lines))
        step = self.settings.batch_chunk_lines
        start = row.ingested_lines
        while start < len(lines):
            chunk = [parse_line(raw, start + i) for i, raw in enumerate(lines[start:start + step])]
            answered = await self._submit_chunk(who, row, start, chunk)
            if answered is None:
                return  # the batch stopped taking lines (cancelled) or another ingest holds it
            task_ids, refusals = answered
            if self.signals.submitted is not None:
                await self.signals.submitted(row.id, start)
            recorded = await store.record(
                self.pool, row.id, start, [line.custom_id for line in chunk], task_ids, refusals,
                self.settings.batch_lease_seconds,
            )
            if not recorded:
                log.info("batch ingest stopped: its lines were recorded by another", extra={"batch_id": row.id})
                now = await store.get_batch(self.pool, row.user_id, row.id)
                if now is not None and now.status in ("cancelling", "cancelled"):
                    for task_id in task_ids:  # the chunk it could not record was submitted after the cancel
                        if task_id is not None:
                            await self.cancel_task(task_id)
                return
            now = await store.get_batch(self.pool, row.user_id, row.id)
            if now is None or now.status == "cancelling":
                await self._cancel_tasks(row.id)
                return
            start += len(chunk)
        log.info("batch ingested", extra={"batch_id": row.id, "lines": len(lines)})

    async def _submit_chunk(
        self, who: Principal, row: BatchRow, start: int, chunk: list[Line]
    ) -> tuple[list[int | None], list[dict[str, Any] | None]] | None:
        """Each line's task id or refusal; refusals that pass are waited out (the lease renewed) and their lines sent
        again. None: the batch stopped taking lines meanwhile."""
        task_ids: list[int | None] = [None] * len(chunk)
        refusals: list[dict[str, Any] | None] = [line.error for line in chunk]
        to_send = [i for i, line in enumerate(chunk) if line.request is not None]
        seen: set[str] = set()
        for i in list(to_send):
            if chunk[i].custom_id in seen:  # an idempotency key names one request: a second line of it is an error
                refusals[i] = {"code": "duplicate_custom_id", "message": f"custom_id {chunk[i].custom_id!r} repeats"}
                to_send.remove(i)
            seen.add(chunk[i].custom_id)
        while to_send:
            requests = []
            for i in to_send:
                request = chunk[i].request
                assert request is not None
                request.idempotency_key = f"{BATCH_PREFIX}{row.id}:{chunk[i].custom_id}"
                if row.end_user:  # the batch names its end user: every line is theirs (else each line says)
                    request.end_user = row.end_user
                request.metadata["batch_id"] = f"{BATCH_PREFIX}{row.id}"
                request.metadata["custom_id"] = chunk[i].custom_id
                requests.append(request)
            answers = await self.submit(who, requests)
            wait = 0.0
            again: list[int] = []
            for i, answer in zip(to_send, answers, strict=True):
                if isinstance(answer, errors.ApiError):
                    delay = passing(answer)
                    if delay is None:
                        refusals[i] = refusal(answer)
                    else:
                        again.append(i)
                        wait = max(wait, delay)
                else:
                    task_ids[i] = int(answer.task.id)
            to_send = again
            if to_send:
                await asyncio.sleep(min(wait, self.settings.batch_lease_seconds / 3))
                if not await store.renew(self.pool, row.id, start, self.settings.batch_lease_seconds):
                    return None
        return task_ids, refusals

    async def _write_files(self, row: BatchRow) -> None:
        """Writes the batch's output and error files from its lines and their tasks, then records them."""
        output: list[bytes] = []
        failed: list[bytes] = []
        expired = False
        for item in await store.items(self.pool, row.id):
            line: dict[str, Any] = {"custom_id": item.custom_id}
            if item.task is None:
                line["error"] = item.error
                failed.append(json.dumps(line).encode())
                continue
            line["task"] = json_format.MessageToDict(item.task.to_proto(), preserving_proto_field_name=True)
            expired = expired or item.task.error_code == "QUEUE_TTL_EXPIRED"
            if item.task.status is Status.SUCCEEDED:
                text = await self.text_of(item.task)
                if text is not None:
                    line["text"] = text
                output.append(json.dumps(line).encode())
            else:
                failed.append(json.dumps(line).encode())
        ids_written: list[int | None] = []
        for purpose, lines in (("batch_output", output), ("batch_error", failed)):
            if not lines:
                ids_written.append(None)
                continue
            data = b"\n".join(lines) + b"\n"
            new_id = self.next_id()
            stored = await self.results.put(f"file-{new_id}", data, "application/jsonl")
            await store.insert_file(
                self.pool,
                new_id,
                row.user_id,
                purpose,
                f"{BATCH_PREFIX}{row.id}_{purpose.removeprefix('batch_')}.jsonl",
                stored.uri,
                len(data),
                hashlib.sha256(data).hexdigest(),
                batch_id=row.id,
            )
            ids_written.append(new_id)
        await store.complete(self.pool, row.id, ids_written[0], ids_written[1], expired=expired)
        log.info(
            "batch files written", extra={"batch_id": row.id, "output_lines": len(output), "error_lines": len(failed)}
        )
