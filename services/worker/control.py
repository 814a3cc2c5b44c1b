"""WorkerControl gRPC: a worker's status and the Drain command, each for an operator only.

A worker holds no API-key pepper (only the services that check keys do), so it does not check the caller's key
itself: it asks TaskAdmin (Authorize) with the caller's own credential, per call and without caching, so a revoked
or lesser key is refused at once.
"""

from __future__ import annotations

import grpc

from services.worker.engine import Worker
from taskgate import channels, errors
from taskgate.config import WorkerSettings
from taskgate_api.v1 import admin_pb2, admin_pb2_grpc, worker_pb2, worker_pb2_grpc

# TaskAdmin's refusals the worker passes on as they came; anything else means the check could not be made
_REFUSALS = (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED)


class Operators:
    """Asks TaskAdmin whether a WorkerControl caller's credential may do an action here."""

    def __init__(self, settings: WorkerSettings) -> None:
        target = settings.worker_admin_target or channels.local_target(settings, settings.scheduler_port)
        self.channel = channels.channel(settings, target)
        self.admin = admin_pb2_grpc.TaskAdminStub(self.channel)
        self.timeout = settings.worker_authorize_timeout_seconds

    async def check(self, context: grpc.aio.ServicerContext, action: str, target: str) -> str:
        """The admin allowed to do `action`; raises UNAUTHENTICATED / PERMISSION_DENIED as TaskAdmin answered, or
        UNAVAILABLE when TaskAdmin cannot be asked."""
        bearer = [(k, v) for k, v in context.invocation_metadata() or () if k == "authorization" and isinstance(v, str)]
        if not bearer:
            raise errors.unauthenticated("WorkerControl needs an admin key (authorization: Bearer ...)")
        try:
            answer = await self.admin.Authorize(
                admin_pb2.AuthorizeRequest(action=action, target=target), metadata=bearer, timeout=self.timeout
            )
        except grpc.aio.AioRpcError as exc:
            if exc.code() in _REFUSALS:
                raise errors.ApiError(exc.code(), f"WorkerControl: {exc.details()}") from None
            raise errors.unavailable(f"cannot check the credential with TaskAdmin: {exc.code().name}") from None
        return str(answer.admin)

    async def close(self) -> None:
        await self.channel.close()


class WorkerControlServicer(worker_pb2_grpc.WorkerControlServicer):
    """Answers GetStatus and Drain for one worker, each after TaskAdmin vouched for the caller."""

    def __init__(self, worker: Worker, operators: Operators) -> None:
        self.worker = worker
        self.operators = operators

    async def GetStatus(
        self, request: worker_pb2.GetStatusRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.GetStatusResponse:
        await self.operators.check(context, "worker.status", self.worker.worker_id)
        return self.worker.status()

    async def Drain(
        self, request: worker_pb2.DrainRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.DrainResponse:
        await self.operators.check(context, "worker.drain", self.worker.worker_id)
        grace = request.grace.ToTimedelta().total_seconds() if request.HasField("grace") else None
        self.worker.begin_drain(grace)
        return worker_pb2.DrainResponse(draining=True, running=len(self.worker.runs))
