"""The TaskGateway gRPC service: its servicer, Gateway, made of the groups of its calls (submit: submitcalls.py, reads:
readcalls.py, a tenant's secrets: secretcalls.py, what they all read: core.py) and its own (cancel, files and batches);
starting and stopping the service."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass

import grpc

from taskgate import clienttokens, errors, ids, store
from taskgate.config import GatewaySettings
from taskgate.model import TaskRow
from taskgate.results import ResultNotFound
from taskgate.runtime import Backends, connect, serve_until_signal, stop_tasks
from taskgate.server import Health, Probes, mark_not_serving, start_server
from taskgate.states import Status
from taskgate.wire import cancel
from taskgate_api import reasons
from taskgate_api.v1 import batches_pb2, gateway_pb2, gateway_pb2_grpc

from .batches import Batches, BatchSignals
from .batchwire import file_proto
from .core import ACTOR, Context
from .readcalls import ReadCalls
from .readcalls import poll_interval as poll_interval  # imported from here by the tests
from .secretcalls import SecretCalls
from .submitcalls import SubmitCalls

log = logging.getLogger("taskgate.submit")

SERVICE_NAME = "taskgate.v1.TaskGateway"


class _Unhurried:
    """The deadline side of a call context for submissions the gateway makes itself (a batch's lines): none."""

    def time_remaining(self) -> float | None:
        return None


class Gateway(SubmitCalls, ReadCalls, SecretCalls):
    """The TaskGateway servicer over one pool and one bus."""

    def __init__(
        self, settings: GatewaySettings, backends: Backends, batch_signals: BatchSignals | None = None
    ) -> None:
        super().__init__(settings, backends)
        self.batches = Batches(
            backends.pool, self._results, settings, self.ids.next,
            submit=lambda who, items: self._submit(who, items, _Unhurried()),
            cancel_task=self._hard_cancel, text_of=self._text_of, signals=batch_signals or BatchSignals(),
        )

    # Cancel and results

    async def CancelTask(
        self, request: gateway_pb2.CancelTaskRequest, context: Context
    ) -> gateway_pb2.CancelTaskResponse:
        who = await self._caller(context, clienttokens.CANCEL)
        task = await self._load(who, ids.require(request.task_id), context)
        if task.status is Status.CANCELED:
            return gateway_pb2.CancelTaskResponse(task=task.to_proto())
        if task.status.terminal:
            raise _already_finished(task)
        mode = store.CancelMode.HARD if request.hard else store.CancelMode.SOFT
        out = await asyncio.wait_for(
            store.cancel(self._pool, task.id, mode=mode, actor=ACTOR, reason=f"{mode.value} cancel by client"),
            self._budget(context),
        )
        current = out.task
        if current is None:
            raise errors.not_found()
        if not out.applied:
            if current.status is Status.CANCELED:
                return gateway_pb2.CancelTaskResponse(task=current.to_proto())
            raise _already_finished(current)
        if out.from_status is Status.PROCESSING:
            await cancel.send(
                self._bus,
                current.id,
                hard=request.hard,
                reason="canceled by client",
                trace_context=current.trace_context,
            )
        self._cache.put(current)
        return gateway_pb2.CancelTaskResponse(task=current.to_proto())

    async def _hard_cancel(self, task_id: int) -> None:
        """Stops one task of a batch being cancelled (its worker told when it runs), as a hard CancelTask would."""
        out = await store.cancel(self._pool, task_id, mode=store.CancelMode.HARD, actor=ACTOR, reason="batch cancelled")
        if out.task is None:
            return
        if out.applied and out.from_status is Status.PROCESSING:
            await cancel.send(
                self._bus, out.task.id, hard=True, reason="batch cancelled", trace_context=out.task.trace_context
            )
        self._cache.put(out.task)

    async def _text_of(self, task: TaskRow) -> str | None:
        """A SUCCEEDED chat task's whole answer (its stored result), for a batch's output file; None for others."""
        if task.task_type != "chat":
            return None
        if task.result_text is not None and len(task.result_text) == (task.result_chars or 0):
            return task.result_text  # kept whole inline
        if task.result_uri is None:
            return task.result_text
        got = bytearray()
        try:
            async for data in self._results.read(task.result_uri):
                got += data
        except ResultNotFound:
            return None
        return got.decode(errors="replace")

    # Files and batches (services/submit/batches.py)

    async def UploadFile(
        self, request_iterator: AsyncIterator[batches_pb2.UploadFileRequest], context: Context
    ) -> batches_pb2.StoredFile:
        who = await self._principal(context)
        return await self.batches.upload(who.tenant_id, request_iterator)

    async def GetFile(self, request: batches_pb2.GetFileRequest, context: Context) -> batches_pb2.StoredFile:
        who = await self._principal(context)
        return file_proto(await self.batches.file(who.tenant_id, request.file_id))

    async def ListFiles(self, request: batches_pb2.ListFilesRequest, context: Context) -> batches_pb2.ListFilesResponse:
        who = await self._principal(context)
        return await self.batches.files(who.tenant_id, request)

    async def GetFileContent(
        self, request: batches_pb2.GetFileRequest, context: Context
    ) -> AsyncIterator[batches_pb2.FileChunk]:
        who = await self._principal(context)
        async for chunk in self.batches.content(who.tenant_id, request.file_id):
            yield chunk

    async def CreateBatch(self, request: batches_pb2.CreateBatchRequest, context: Context) -> batches_pb2.Batch:
        return await self.batches.create(await self._principal(context), request)

    async def GetBatch(self, request: batches_pb2.GetBatchRequest, context: Context) -> batches_pb2.Batch:
        return await self.batches.get(await self._principal(context), request.batch_id)

    async def ListBatches(
        self, request: batches_pb2.ListBatchesRequest, context: Context
    ) -> batches_pb2.ListBatchesResponse:
        return await self.batches.listing(await self._principal(context), request)

    async def CancelBatch(self, request: batches_pb2.CancelBatchRequest, context: Context) -> batches_pb2.Batch:
        return await self.batches.cancel(await self._principal(context), request.batch_id)


def _already_finished(task: TaskRow) -> errors.ApiError:
    return errors.failed_precondition(
        reasons.TASK_FINISHED, f"the task already finished as {task.status.value}", status=task.status.value
    )


@dataclass
class SubmitHandle:
    """A running submit service: its port, and how to stop it in stages."""

    port: int
    server: grpc.aio.Server
    health: Health
    gateway: Gateway
    backends: Backends
    owns_backends: bool
    settings: GatewaySettings
    listening: asyncio.Task[None]

    async def stop(self, grace: float | None = None) -> None:
        """Readiness off, stop accepting, let in-flight calls finish within `grace`, then close the backends."""
        try:
            await mark_not_serving(self.health)
            self.gateway.draining.set()  # SubmitStream streams answer what they read and end, so clients go elsewhere
            grace = self.settings.submit_shutdown_grace_seconds if grace is None else grace
            await self.server.stop(grace)
            await self.gateway.batches.close()  # an ingest stopped here is resumed by the next read of its batch
            await self.gateway.dispatcher.close(grace)  # what it could not dispatch stays CREATED for the scan
        finally:
            await stop_tasks([self.listening])
            await self.gateway.inputs.close()
            await self.gateway.ids.close()
            if self.owns_backends:
                await self.backends.close()


async def start(
    settings: GatewaySettings, backends: Backends | None = None, *, batch_signals: BatchSignals | None = None
) -> SubmitHandle:
    """Starts the gateway on settings.submit_port (0 = ephemeral), connecting its own backends unless given."""
    owns = backends is None
    if backends is None:
        backends = await connect(settings, "submit")
    gateway = Gateway(settings, backends, batch_signals)

    def register(server: grpc.aio.Server) -> Iterable[str]:
        gateway_pb2_grpc.add_TaskGatewayServicer_to_server(gateway, server)
        return [SERVICE_NAME]

    try:
        await gateway.ids.start()
        server, port, health_servicer = await start_server(
            settings, settings.submit_port, register, Probes(pool=backends.pool, bus=backends.bus))
    except BaseException:
        await gateway.ids.close()
        if owns:
            await backends.close()
        raise
    listening = asyncio.create_task(gateway.revocations.run(), name="submit-revocations")
    return SubmitHandle(port, server, health_servicer, gateway, backends, owns, settings, listening)


async def main(settings: GatewaySettings) -> None:
    """Runs the gateway until SIGTERM or SIGINT, then shuts down in stages."""
    await serve_until_signal(lambda: start(settings), grace_seconds=settings.submit_shutdown_grace_seconds)
