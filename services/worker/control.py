"""WorkerControl gRPC: a worker's status and the Drain command."""

from __future__ import annotations

import grpc

from services.worker.engine import Worker
from taskgate.v1 import worker_pb2, worker_pb2_grpc


class WorkerControlServicer(worker_pb2_grpc.WorkerControlServicer):
    """Answers GetStatus and Drain for one worker."""

    def __init__(self, worker: Worker) -> None:
        self.worker = worker

    async def GetStatus(self, request: worker_pb2.GetStatusRequest, context: grpc.aio.ServicerContext) -> worker_pb2.GetStatusResponse:
        return self.worker.status()

    async def Drain(self, request: worker_pb2.DrainRequest, context: grpc.aio.ServicerContext) -> worker_pb2.DrainResponse:
        grace = request.grace.ToTimedelta().total_seconds() if request.HasField("grace") else None
        self.worker.begin_drain(grace)
        return worker_pb2.DrainResponse(draining=True, running=len(self.worker.runs))
