"""`python -m bench.ceiling`: the raw ceiling, a bare grpc.aio SubmitTask doing only INSERT + JetStream publish +
UPDATE.

No authentication, limits, validation, idempotency or interceptor: what is left is the work every durable submit
must do, so the gateway's throughput can be read as a fraction of it. Configured by TASKGATE_DATABASE_URL,
TASKGATE_NATS_URL and TASKGATE_SUBMIT_PORT; several processes may share the port (SO_REUSEPORT).
"""

from __future__ import annotations

import asyncio
import os
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from taskgate import bus as busmod
from taskgate import ids
from taskgate.runtime import stop_signal
from taskgate.store import bench as bench_store
from taskgate.store import create_pool
from taskgate.wire import dispatch
from taskgate_api.v1 import gateway_pb2, task_pb2

TENANT = "bench-ceiling"


class Ceiling:
    """SubmitTask as three steps: the row, the message, the QUEUED update."""

    def __init__(self, pool: Any, bus: busmod.Bus) -> None:
        self.pool = pool
        self.bus = bus

    async def SubmitTask(self, request: gateway_pb2.SubmitTaskRequest, context: Any) -> gateway_pb2.SubmitTaskResponse:
        task_id = ids.new_id()
        model = request.model_id or "sleepy"
        subject = busmod.task_subject(model, 5)
        await bench_store.ceiling_insert(
            self.pool, task_id=task_id, tenant=TENANT, key=request.idempotency_key, prompt=request.prompt, model=model,
            queue_name=subject,
        )
        message = dispatch.encode_fields(task_id, model, task_pb2.PRIORITY_NORMAL)
        await self.bus.js.publish(subject, message, headers={"Nats-Msg-Id": f"{task_id}.q0"})
        await bench_store.ceiling_queue(self.pool, task_id)
        return gateway_pb2.SubmitTaskResponse(
            task=task_pb2.Task(id=str(task_id), status=task_pb2.TASK_STATUS_QUEUED), created=True
        )


async def main() -> None:
    pool = await create_pool(os.environ["TASKGATE_DATABASE_URL"], int(os.environ.get("TASKGATE_DB_POOL_SIZE", "10")))
    bus = await busmod.connect(os.environ["TASKGATE_NATS_URL"], "bench-ceiling")
    server = grpc.aio.server(options=[("grpc.so_reuseport", 1)])
    handler = grpc.unary_unary_rpc_method_handler(
        Ceiling(pool, bus).SubmitTask,
        request_deserializer=gateway_pb2.SubmitTaskRequest.FromString,
        response_serializer=gateway_pb2.SubmitTaskResponse.SerializeToString,
    )
    server.add_generic_rpc_handlers(
        [grpc.method_handlers_generic_handler("taskgate.v1.TaskGateway", {"SubmitTask": handler})]
    )
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    server.add_insecure_port(f"127.0.0.1:{os.environ['TASKGATE_SUBMIT_PORT']}")
    async with stop_signal() as stop:
        await server.start()
        await health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
        await stop.wait()
    await server.stop(1)
    await bus.close()
    await pool.close()


if __name__ == "__main__":
    asyncio.run(main())
