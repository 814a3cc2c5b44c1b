"""Dead-worker recovery: SIGKILL the worker running a task; seconds until another worker runs it."""

from __future__ import annotations

import asyncio
import time

import grpc
import nats

from bench.stack import LONG_MODEL, BenchStack
from bench.stats import Report
from taskgate import bus as busmod
from taskgate_api.v1 import gateway_pb2, gateway_pb2_grpc, task_pb2

WAIT = 120.0  # seconds a killed worker's task may take to run again before the figure reads "> WAIT"


async def _wait(check: object, within: float) -> None:
    deadline = time.monotonic() + within
    while True:
        if await check():  # type: ignore[operator]
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"not within {within}s")
        await asyncio.sleep(0.02)


async def dead_worker(stack: BenchStack, report: Report, section: str, label: str, target_s: float | None) -> None:
    """One long task; its worker is SIGKILLed mid-run; the figure is kill -> PROCESSING again elsewhere."""
    md = (("authorization", f"Bearer {stack.api_key}"),)
    async with grpc.aio.insecure_channel(stack.submit_address) as channel:
        stub = gateway_pb2_grpc.TaskGatewayStub(channel)
        request = gateway_pb2.SubmitTaskRequest(
            prompt=f"recovery {label}", model_id=LONG_MODEL, idempotency_key=f"recovery-{time.time_ns()}",
            params=task_pb2.VideoParams(num_inference_steps=100),
        )
        task_id = int((await stub.SubmitTask(request, metadata=md, timeout=10)).task.id)

        async def running() -> bool:
            return bool(await stack.db.fetchval("SELECT status = 'PROCESSING' FROM task WHERE id = $1", task_id))

        await _wait(running, 30)
        await asyncio.sleep(1.0)  # mid-run: a heartbeat or two has gone by
        holder_id = await stack.db.fetchval("SELECT worker_id FROM task WHERE id = $1", task_id)
        victim = next(n for n in stack.worker_names() if stack.worker_id(stack.cluster[n]) == holder_id)
        t0 = time.monotonic()
        stack.cluster.kill(victim)

        async def again() -> bool:
            return bool(
                await stack.db.fetchval(
                    "SELECT status = 'PROCESSING' AND attempt >= 2 FROM task WHERE id = $1", task_id
                )
            )

        try:
            await _wait(again, WAIT)
            seconds: float | None = time.monotonic() - t0
        except TimeoutError:
            seconds = None
        shown = f"> {WAIT:g} s" if seconds is None else ""
        report.add(section, f"dead-worker recovery, {label}", seconds, "s", at_most=target_s, shown=shown)
        await stub.CancelTask(gateway_pb2.CancelTaskRequest(task_id=str(task_id), hard=True), metadata=md, timeout=10)
    await stack.cluster.restart(victim)


async def with_lease(stack: BenchStack, report: Report, section: str, lease: float) -> None:
    """Every process restarted with `lease_seconds` (the consumers' ack wait follows it), then the same measurement."""
    c = stack.cluster
    running = [n for n, s in c.services.items() if s.alive]
    await stack.stop_group(running)
    assert stack.settings.nats_url is not None
    nc = await nats.connect(stack.settings.nats_url)
    try:
        js = nc.jetstream()
        for info in await js.consumers_info(busmod.TASKS_STREAM):
            assert info.name is not None
            await js.delete_consumer(busmod.TASKS_STREAM, info.name)
    finally:
        await nc.close()
    stack.declare(lease_seconds=lease)
    await c.start("scheduler", "notifier", *stack.submits(), *stack.worker_names())
    await dead_worker(stack, report, section, f"lease {lease:g} s (other settings shipped defaults)", None)
