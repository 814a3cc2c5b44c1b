"""Fleet: N sleep-only workers x S slots, every slot holding a task that runs for T seconds with progress at every step.

What a running task costs the server side while it runs (CPU per running task-second of each process: PostgreSQL,
notifier, worker, NATS, submit, scheduler), and the WatchTasks event latency meanwhile (mostly progress events: each
worker writes its tasks' progress in small batches, progress_flush_seconds apart). The measured window opens once every
task is running and closes before the first one can finish; running task-seconds are counted from the tasks' own start
and finish times, so a slow ramp or an early end is not counted as running.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass
from typing import Any

import grpc

from bench import cpu
from bench.stack import FLEET_MODEL, BenchStack
from bench.stats import Report, ms
from taskgate.store import bench as bench_store
from taskgate_api.v1 import events_pb2, events_pb2_grpc, gateway_pb2, gateway_pb2_grpc, task_pb2

MARGIN = 0.5  # seconds the window closes before the first task could finish
IDLE_SECONDS = 3.0  # the idle stack's CPU is measured this long before the tasks are submitted


@dataclass(frozen=True)
class FleetOptions:
    """The fleet's size: `workers` processes of `slots` slots, `tasks` tasks (0: one per slot) of `seconds` seconds
    and `steps` steps each (a progress report per step; the worker writes at most one per progress_interval)."""

    workers: int = 2
    slots: int = 100
    tasks: int = 0
    seconds: float = 20.0
    steps: int = 20

    @property
    def count(self) -> int:
        return self.tasks or self.workers * self.slots


def running_seconds(spans: list[tuple[float, float | None]], start: float, end: float) -> float:
    """Task-seconds of running inside [start, end], from each task's (started, finished or None) wall times."""
    total = 0.0
    for began, finished in spans:
        stop = end if finished is None else min(end, finished)
        total += max(0.0, stop - max(start, began))
    return total


def worker_names(opts: FleetOptions) -> list[str]:
    return [f"worker-fleet-{i}" for i in range(1, opts.workers + 1)]  # "worker-…": cpu.snapshot counts them as workers


async def measure(stack: BenchStack, report: Report, section: str, opts: FleetOptions) -> None:
    """Starts the fleet's workers, fills every slot, measures, then cancels the tasks and stops the fleet."""
    names = worker_names(opts)
    for name in names:
        stack.cluster.add(name, "services.worker", worker_slots=opts.slots, worker_models=[FLEET_MODEL])
    await stack.purge_tasks_stream()
    await stack.cluster.start(*names)
    md = (("authorization", f"Bearer {stack.api_key}"),)
    streamed: list[tuple[task_pb2.TaskEvent, float]] = []
    try:
        async with (
            grpc.aio.insecure_channel(stack.submit_address) as gw,
            grpc.aio.insecure_channel(stack.notifier_address) as ev,
        ):
            gateway = gateway_pb2_grpc.TaskGatewayStub(gw)
            watch = events_pb2_grpc.TaskEventsStub(ev).WatchTasks(events_pb2.WatchTasksRequest(), metadata=md)
            live = asyncio.Event()

            async def collect() -> None:
                async for item in watch:
                    if item.HasField("event"):
                        streamed.append((item.event, time.time()))
                    else:
                        live.set()  # the first keep-alive: caught up, live from here

            collector = asyncio.create_task(collect())
            try:
                await asyncio.wait_for(live.wait(), 30)
                idle = await _idle_cores(stack)
                figures = await _run(stack, gateway, md, opts, streamed) | {"idle_cores": idle}
            finally:
                watch.cancel()
                with contextlib.suppress(asyncio.CancelledError, grpc.aio.AioRpcError):
                    await collector
    finally:
        await stack.close_open_tasks()
        await stack.stop_group(names)
        await stack.purge_tasks_stream()
    _report(report, section, opts, figures)


async def _idle_cores(stack: BenchStack) -> dict[str, float]:
    """Each part's CPU (cores) with the fleet started and nothing to run: the stack's fixed cost, for comparison."""
    began, before = time.monotonic(), cpu.snapshot(stack)
    await asyncio.sleep(IDLE_SECONDS)
    return {k: v / 1000 for k, v in cpu.per_unit(before, cpu.snapshot(stack), time.monotonic() - began).items()}


async def _submit(gateway: gateway_pb2_grpc.TaskGatewayStub, md: Any, opts: FleetOptions) -> list[int]:
    """The fleet's tasks through SubmitTasks, 100 per call."""
    params = task_pb2.VideoParams(num_inference_steps=opts.steps)
    tag = f"fleet-{time.time_ns()}"
    requests = [gateway_pb2.SubmitTaskRequest(prompt=f"fleet task {i}", model_id=FLEET_MODEL, params=params,
                                              idempotency_key=f"{tag}-{i}") for i in range(opts.count)]
    ids: list[int] = []
    for first in range(0, len(requests), 100):
        answer = await gateway.SubmitTasks(gateway_pb2.SubmitTasksRequest(requests=requests[first:first + 100]),
                                           metadata=md, timeout=60)
        for item in answer.results:
            if item.HasField("error"):
                raise RuntimeError(f"SubmitTasks refused a fleet task: {item.error.message}")
            ids.append(int(item.response.task.id))
    return ids


async def _run(stack: BenchStack, gateway: gateway_pb2_grpc.TaskGatewayStub, md: Any, opts: FleetOptions,
               streamed: list[tuple[task_pb2.TaskEvent, float]]) -> dict[str, Any]:
    submitted = time.time()
    ids = await _submit(gateway, md, opts)
    # The first task cannot finish before `seconds` after the submit began: the window must close before that.
    closes = submitted + opts.seconds - MARGIN
    running = 0
    while time.time() < closes - 1.0:
        running = (await bench_store.count_by_status(stack.db, ids)).get("PROCESSING", 0)
        if running >= len(ids):
            break
        await asyncio.sleep(0.1)
    ramp = time.time() - submitted
    start = time.time()
    before = cpu.snapshot(stack)
    await asyncio.sleep(max(0.0, closes - time.time()))
    after = cpu.snapshot(stack)
    end = time.time()
    rows = await stack.db.fetch(
        "SELECT extract(epoch FROM started_at)::float8 AS began, extract(epoch FROM finished_at)::float8 AS finished"
        " FROM task WHERE id = ANY($1::bigint[]) AND started_at IS NOT NULL", ids)
    task_seconds = running_seconds([(r["began"], r["finished"]) for r in rows], start, end)
    wanted = {str(i) for i in ids}
    inside = [(event, when) for event, when in streamed if event.task_id in wanted and start <= when <= end]
    return {
        "ids": ids,
        "running_at_start": running,
        "ramp_s": ramp,
        "window_s": end - start,
        "task_seconds": task_seconds,
        "costs": cpu.per_unit(before, after, task_seconds),
        "latencies": [when - _wall(event.at) for event, when in inside],
        "progress_events": sum(1 for event, _ in inside if event.to_status == event.from_status),
    }


def _wall(ts: Any) -> float:
    return float(ts.seconds) + ts.nanos / 1e9


def _report(report: Report, section: str, opts: FleetOptions, figures: dict[str, Any]) -> None:
    window, task_seconds, costs = figures["window_s"], figures["task_seconds"], figures["costs"]
    mean_running = task_seconds / window if window > 0 else 0.0
    report.add(section, "tasks running in the measured window (mean)", mean_running, "tasks",
               note=f"{figures['running_at_start']} of {opts.count} running {figures['ramp_s']:.1f} s after the submit "
                    f"began; window {window:.1f} s, {task_seconds:,.0f} running task-seconds")
    if window < 2.0 or task_seconds <= 0:
        report.skip(section, "server-side CPU per running task-second",
                    f"window too short ({window:.1f} s): make the tasks longer (--fleet-seconds) or fewer")
        return
    idle = figures["idle_cores"]
    report.add(section, "server-side CPU per running task-second", sum(costs.values()), "ms", at_most=0.3,
               note=", ".join(f"{k} {v:.3f}" for k, v in costs.items()))
    for part, value in costs.items():
        report.add(section, f"CPU per running task-second: {part}", value, "ms",
                   note=f"{idle.get(part, 0.0):.3f} cores with nothing running "
                        f"({idle.get(part, 0.0) * 1000 / mean_running:.3f} ms per running task-second of the "
                        f"{mean_running:.0f})" if mean_running else "")
    report.add(section, "idle notifier cores", idle.get("notifier", 0.0), "cores", at_most=0.02,
               note=f"the notifier with the fleet's workers started, nothing running and one WatchTasks stream open, "
                    f"measured {IDLE_SECONDS:g} s before the submit")
    above = sum(costs.values()) - sum(idle.values()) * 1000 / mean_running if mean_running else float("nan")
    report.add(section, "server-side CPU per running task-second above the idle stack", above, "ms",
               note=f"the idle stack: {sum(idle.values()):.3f} cores, measured {IDLE_SECONDS:g} s before the submit")
    latencies = figures["latencies"]
    p50, p99 = ms(latencies)
    rate = len(latencies) / window
    report.add(section, f"WatchTasks event latency while {mean_running:.0f} run, p50", p50, "ms",
               note=f"{len(latencies):,} events ({rate:,.0f}/s, {figures['progress_events']:,} of them progress)")
    report.add(section, f"WatchTasks event latency while {mean_running:.0f} run, p99", p99, "ms", at_most=20)
    report.raw["fleet"] = {
        "workers": opts.workers, "slots": opts.slots, "tasks": opts.count, "task_seconds_each": opts.seconds,
        "steps": opts.steps, "ramp_s": round(figures["ramp_s"], 2), "window_s": round(window, 2),
        "running_task_seconds": round(task_seconds, 1), "cpu_ms_per_running_task_second": costs,
        "idle_cores": {k: round(v, 4) for k, v in idle.items()},
        "events": len(latencies), "progress_events": figures["progress_events"],
        "event_latency_ms": {"p50": round(p50, 2), "p99": round(p99, 2)},
    }
