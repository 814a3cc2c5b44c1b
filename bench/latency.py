"""One task at a time through idle workers: dispatch, end-to-end, stream and webhook latencies."""

from __future__ import annotations

import asyncio
import contextlib
import statistics
import time
from datetime import datetime
from typing import Any

import grpc

from bench.stack import BenchStack
from bench.stats import Report, ms
from taskgate_api.v1 import events_pb2, events_pb2_grpc, gateway_pb2, gateway_pb2_grpc, task_pb2
from tests.support.harness import wait_for
from tests.support.webhooks import WebhookReceiver

TERMINAL = {
    task_pb2.TASK_STATUS_SUCCEEDED,
    task_pb2.TASK_STATUS_FAILED,
    task_pb2.TASK_STATUS_TIMEOUT,
    task_pb2.TASK_STATUS_CANCELED,
}


def _wall(ts: Any) -> float:
    return float(ts.seconds) + ts.nanos / 1e9


async def measure(stack: BenchStack, report: Report, section: str, count: int) -> None:
    """Submits `count` no-op tasks one by one (workers idle), each followed with WatchTask to its end."""
    md = (("authorization", f"Bearer {stack.api_key}"),)
    streamed: list[tuple[task_pb2.TaskEvent, float]] = []
    returned: dict[str, float] = {}
    e2e: list[float] = []
    ended: list[float] = []  # a terminal event's row written -> its WatchTask stream receives it
    async with (
        WebhookReceiver() as receiver,
        grpc.aio.insecure_channel(stack.submit_address) as gw,
        grpc.aio.insecure_channel(stack.notifier_address) as ev,
    ):
        gateway = gateway_pb2_grpc.TaskGatewayStub(gw)
        events = events_pb2_grpc.TaskEventsStub(ev)
        watch_all = events.WatchTasks(events_pb2.WatchTasksRequest(), metadata=md)

        async def collect() -> None:
            async for item in watch_all:
                if item.HasField("event"):
                    streamed.append((item.event, time.time()))

        collector = asyncio.create_task(collect())
        await asyncio.sleep(1.0)  # the tenant-wide stream subscribes before the first task
        for i in range(count):
            request = gateway_pb2.SubmitTaskRequest(
                prompt=f"latency task {i}", model_id="sleepy", idempotency_key=f"latency-{time.time_ns()}-{i}",
                callback_url=receiver.url(), params=task_pb2.VideoParams(num_inference_steps=1),
            )
            resp = await gateway.SubmitTask(request, metadata=md, timeout=10)
            done_at = time.time()
            returned[resp.task.id] = done_at
            async for item in events.WatchTask(
                events_pb2.WatchTaskRequest(task_id=resp.task.id), metadata=md, timeout=30
            ):
                status = item.snapshot.status if item.HasField("snapshot") else item.event.to_status
                if item.HasField("keepalive"):
                    continue
                if status in TERMINAL:
                    e2e.append(time.time() - done_at)
                    if item.HasField("event"):
                        ended.append(time.time() - _wall(item.event.at))
                    break
            await asyncio.sleep(0.005)
        with contextlib.suppress(TimeoutError):
            await wait_for(lambda: len({r.headers.get("webhook-id") for r in receiver.requests}) >= count, 30)
        await asyncio.sleep(0.5)  # the last events reach the tenant stream
        watch_all.cancel()
        with contextlib.suppress(asyncio.CancelledError, grpc.aio.AioRpcError):
            await collector
        webhooks = list(receiver.requests)

    ids = [int(t) for t in returned]
    rows = await stack.db.fetch(
        "SELECT task_id, from_status::text AS src, to_status::text AS dst, extract(epoch FROM at)::float8 AS at"
        " FROM task_event WHERE task_id = ANY($1::bigint[]) ORDER BY task_id, version",
        ids,
    )
    created: dict[int, float] = {}
    queued: dict[int, float] = {}
    claimed: dict[int, float] = {}
    claimed_from: dict[int, str] = {}
    finished: dict[int, float] = {}
    for r in rows:
        if r["dst"] == "CREATED":
            created[r["task_id"]] = r["at"]
        elif r["dst"] == "QUEUED" and r["task_id"] not in claimed:
            queued[r["task_id"]] = r["at"]
        elif r["dst"] == "PROCESSING" and r["task_id"] not in claimed:
            claimed[r["task_id"]], claimed_from[r["task_id"]] = r["at"], r["src"]
        elif r["dst"] in ("SUCCEEDED", "FAILED") and r["task_id"] not in finished:
            finished[r["task_id"]] = r["at"]
    dispatch = [claimed[t] - created[t] for t in ids if t in claimed and t in created]
    after_return = [claimed[int(t)] - at for t, at in returned.items() if int(t) in claimed]
    stream = [when - _wall(event.at) for event, when in streamed if event.task_id in returned]
    first_hook: dict[str, float] = {}
    for hook in webhooks:
        wid = hook.headers.get("webhook-id", "")
        if wid in first_hook:
            continue
        data = hook.json()["data"]
        first_hook[wid] = hook.wall - datetime.fromisoformat(data["event_at"].replace("Z", "+00:00")).timestamp()

    p50, p99 = ms(dispatch)
    report.add(section, "dispatch: row committed -> worker claimed, p50", p50, "ms", at_most=2,
               note="from the admission transaction's start: its statement and durable commit included")
    report.add(section, "dispatch: row committed -> worker claimed, p99", p99, "ms", at_most=5)
    p50, p99 = ms(after_return)
    report.add(section, "dispatch: submit returned -> worker claimed, p50 / p99", p50, "ms",
               note=f"p99 {p99:.1f} ms (negative: claimed before the response arrived)")
    hops(report, section, created, queued, claimed, claimed_from, finished)
    p50, p99 = ms(e2e)
    report.add(section, "terminal state seen by a streaming client after submit returns, p50", p50, "ms", at_most=5,
               note=f"p99 {p99:.1f} ms")
    p50, p99 = ms(ended)
    report.add(section, "WatchTask: terminal event written -> received, p50", p50, "ms",
               note=f"p99 {p99:.1f} ms, {len(ended)} events")
    p50, p99 = ms(stream)
    report.add(section, "stream: event committed -> WatchTasks receives, p50", p50, "ms", note=f"{len(stream)} events")
    report.add(section, "stream: event committed -> WatchTasks receives, p99", p99, "ms", at_most=20)
    hooks = list(first_hook.values())
    p50, p99 = ms(hooks)
    report.add(
        section,
        "webhook: terminal event -> first POST arrives, p50",
        p50,
        "ms",
        at_most=20,
        note=f"{len(hooks)} webhooks",
    )
    report.add(section, "webhook: terminal event -> first POST arrives, p99", p99, "ms", at_most=100)
    report.raw["latency"] = {
        "tasks": count, "dispatch_ms": sorted(round(x * 1000, 3) for x in dispatch),
        "e2e_ms": sorted(round(x * 1000, 3) for x in e2e), "stream_events": len(stream), "webhooks": len(hooks),
    }


def compare_with_celery(report: Report) -> None:
    """The terminal state seen by a streaming client against Celery's result seen by its client (issue 38: at most
    Celery's p50), when both were measured."""
    ours = report.raw.get("latency", {}).get("e2e_ms")
    celery = next((p50 for section, p50 in report.raw.get("result_seen_p50_ms", {}).items() if "Celery" in section),
                  None)
    name = "terminal seen by a streaming client / Celery's result seen, p50"
    if not ours or not celery:
        report.skip("latency", name, "not every system was measured")
        return
    p50 = statistics.median(ours)
    report.add("latency", name, p50 / celery, "x", at_most=1, note=f"{p50:.2f} ms against {celery:.2f} ms")


def hops(
    report: Report, section: str, created: dict[int, float], queued: dict[int, float], claimed: dict[int, float],
    claimed_from: dict[int, str], finished: dict[int, float],
) -> None:
    """The dispatch and run hops from the rows' own times (each the start of the transaction that wrote it):
    admission -> QUEUED move, QUEUED move -> claim, claim -> terminal commit; and how many claims found their task
    CREATED (the claim outran the move) or began within 2 ms after the move began (it may have waited on its lock)."""
    to_queue = [queued[t] - created[t] for t in queued if t in created]
    after_move = [claimed[t] - queued[t] for t in queued if t in claimed and claimed_from.get(t) == "QUEUED"]
    ran = [finished[t] - claimed[t] for t in finished if t in claimed]
    close = sum(1 for x in after_move if x < 0.002)
    p50, p99 = ms(to_queue)
    report.add(section, "hop: admission began -> QUEUED move began, p50", p50, "ms",
               note=f"p99 {p99:.1f} ms, {len(to_queue)} moves")
    p50, p99 = ms(after_move)
    report.add(section, "hop: QUEUED move began -> claim began, p50", p50, "ms",
               note=f"p99 {p99:.1f} ms; {close} of {len(after_move)} claims began < 2 ms after the move")
    report.add(section, "hop: claims that found their task still CREATED", float(
        sum(1 for v in claimed_from.values() if v == "CREATED")), "", note=f"of {len(claimed_from)}")
    p50, p99 = ms(ran)
    report.add(section, "hop: claim began -> terminal commit began (claim, run, store), p50", p50, "ms",
               note=f"p99 {p99:.1f} ms")
