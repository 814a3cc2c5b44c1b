"""Streams: M WatchTask streams on one notifier, over several gRPC channels, then a burst of terminal events.

M QUEUED tasks (workers stopped), one WatchTask stream each. Reported: how many opened (got their snapshot), how many
the server dropped (ended without the client ending them and without a terminal event) with their status codes and
details, the notifier's RSS per stream (its growth over the opening / M), the notifier's CPU while the streams sit idle
(in cores, over one keep-alive period by default, so every stream's keep-alive is in it), then K of the watched tasks
cancelled at once and the latency from each terminal event's commit to its stream. Every step has a deadline: when the
notifier cannot hold M streams the phase still ends and says what happened.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import grpc

from bench import cpu
from bench.stack import BenchStack
from bench.stats import Report, ms
from taskgate_api.v1 import events_pb2, events_pb2_grpc, gateway_pb2, gateway_pb2_grpc, task_pb2

BASELINE_SECONDS = 5.0  # the notifier's idle CPU before any stream opens, for comparison
TERMINAL = {
    task_pb2.TASK_STATUS_SUCCEEDED,
    task_pb2.TASK_STATUS_FAILED,
    task_pb2.TASK_STATUS_TIMEOUT,
    task_pb2.TASK_STATUS_CANCELED,
}


@dataclass(frozen=True)
class StreamsOptions:
    """`streams` WatchTask streams over `channels` channels (HTTP/2 connections), at most `opening` being opened at a
    time; `idle` seconds of idle measurement (0: one keep-alive period); `burst` tasks cancelled at once."""

    streams: int = 10_000
    channels: int = 20
    opening: int = 200
    idle: float = 0.0
    burst: int = 1_000
    open_within: float = 180.0  # the opening's deadline
    burst_within: float = 30.0  # how long the burst's terminal events may take to arrive


@dataclass
class Watch:
    """One client stream: when it opened, what it received, how it ended."""

    task_id: str
    call: Any = None
    opened: float | None = None
    keepalives: int = 0
    terminal: tuple[float, float] | None = None  # (event committed, received), wall clock
    # None: still open; "client": we ended it; "terminal": after its terminal event; else a drop
    ended: str | None = None
    details: str = ""
    ended_at: float | None = None
    ready: asyncio.Event = field(default_factory=asyncio.Event)  # set on the snapshot or the end, whichever comes first

    @property
    def dropped(self) -> bool:
        return self.ended not in (None, "client", "terminal")


async def _follow(watch: Watch, stub: events_pb2_grpc.TaskEventsStub, md: Any, gate: asyncio.Semaphore) -> None:
    """Opens one WatchTask stream (holding a place in `gate` until its snapshot arrives) and reads it to its end."""
    async with contextlib.AsyncExitStack() as held:
        await held.enter_async_context(gate)
        try:
            watch.call = stub.WatchTask(events_pb2.WatchTaskRequest(task_id=watch.task_id), metadata=md)
            async for item in watch.call:
                now = time.time()
                if item.HasField("snapshot"):
                    watch.opened = now
                    watch.ready.set()
                    await held.aclose()  # the next stream may open
                elif item.HasField("keepalive"):
                    watch.keepalives += 1
                elif item.event.to_status in TERMINAL:
                    watch.terminal = (_wall(item.event.at), now)
            watch.ended = "terminal" if watch.terminal else "OK (no terminal event)"
        except asyncio.CancelledError:  # only this client cancels its calls and tasks locally
            watch.ended = "client"
        except grpc.aio.AioRpcError as exc:
            if watch.ended is None:  # else the client had ended it first
                watch.ended = exc.code().name
                watch.details = exc.details() or ""
        finally:
            watch.ended_at = time.time()
            watch.ready.set()


async def _cores(pid: int, seconds: float) -> float:
    """The CPU a process uses over the next `seconds`, in cores."""
    began, used = time.monotonic(), cpu.cpu_seconds(pid) or 0.0
    await asyncio.sleep(seconds)
    return ((cpu.cpu_seconds(pid) or 0.0) - used) / (time.monotonic() - began)


def _wall(ts: Any) -> float:
    return float(ts.seconds) + ts.nanos / 1e9


async def _create_tasks(gateway: gateway_pb2_grpc.TaskGatewayStub, md: Any, count: int) -> list[str]:
    """`count` QUEUED no-op tasks (workers are stopped), through SubmitTasks, 100 per call, 4 calls in flight."""
    tag = f"streams-{time.time_ns()}"
    params = task_pb2.VideoParams(num_inference_steps=1)
    chunks = [range(first, min(count, first + 100)) for first in range(0, count, 100)]
    gate = asyncio.Semaphore(4)

    async def send(chunk: range) -> list[str]:
        async with gate:
            answer = await gateway.SubmitTasks(gateway_pb2.SubmitTasksRequest(requests=[
                gateway_pb2.SubmitTaskRequest(prompt=f"streams task {i}", model_id="sleepy", params=params,
                                              idempotency_key=f"{tag}-{i}") for i in chunk]), metadata=md, timeout=60)
        for item in answer.results:
            if item.HasField("error"):
                raise RuntimeError(f"SubmitTasks refused a streams task: {item.error.message}")
        return [item.response.task.id for item in answer.results]

    return [task_id for ids in await asyncio.gather(*(send(c) for c in chunks)) for task_id in ids]


def _drops(watches: list[Watch], since: float = 0.0) -> Counter[str]:
    """Dropped streams by status (and the first words of their details), those that ended at or after `since`."""
    out: Counter[str] = Counter()
    for w in watches:
        if w.dropped and (w.ended_at or 0.0) >= since:
            out[f"{w.ended}: {w.details[:60]}" if w.details else str(w.ended)] += 1
    return out


async def measure(stack: BenchStack, report: Report, section: str, opts: StreamsOptions) -> None:
    md = (("authorization", f"Bearer {stack.api_key}"),)
    pid = cpu.service_pid(stack, "notifier")
    idle_seconds = opts.idle or stack.settings.stream_keepalive_seconds
    options = [("grpc.use_local_subchannel_pool", 1)]  # one HTTP/2 connection per channel
    channels = [
        grpc.aio.insecure_channel(stack.notifier_address, options=options) for _ in range(max(1, opts.channels))
    ]
    watches: list[Watch] = []
    followers: list[asyncio.Task[None]] = []
    try:
        async with grpc.aio.insecure_channel(stack.submit_address) as gw:
            gateway = gateway_pb2_grpc.TaskGatewayStub(gw)
            ids = await _create_tasks(gateway, md, opts.streams)
            await asyncio.gather(*(ch.channel_ready() for ch in channels))
            stubs = [events_pb2_grpc.TaskEventsStub(ch) for ch in channels]
            await asyncio.sleep(1.0)  # the submit's events relayed, the notifier quiet again
            rss_before = cpu.rss_bytes(pid) or 0
            baseline = await _cores(pid, min(idle_seconds, BASELINE_SECONDS))  # the notifier idle without any stream

            # Opening: every stream until its snapshot (or its end), at most `opening` at a time.
            gate = asyncio.Semaphore(opts.opening)
            began = time.time()
            watches = [Watch(task_id) for task_id in ids]
            followers = [
                asyncio.create_task(_follow(w, stubs[i % len(stubs)], md, gate)) for i, w in enumerate(watches)
            ]
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.gather(*(w.ready.wait() for w in watches)), opts.open_within)
            open_seconds = time.time() - began
            opened = sum(1 for w in watches if w.opened is not None)
            await asyncio.sleep(1.0)
            rss_after = cpu.rss_bytes(pid) or 0
            dropped_opening = _drops(watches)

            # Idle: nothing happens but keep-alives.
            idle_from = time.time()
            keepalives = sum(w.keepalives for w in watches)
            idle_cores = await _cores(pid, idle_seconds)
            keepalives = sum(w.keepalives for w in watches) - keepalives
            dropped_idle = _drops(watches, idle_from)

            # Burst: K watched tasks cancelled at once; each terminal event's commit -> its stream.
            alive = [i for i, w in enumerate(watches) if w.opened is not None and w.ended is None][: opts.burst]
            chosen = [watches[i] for i in alive]
            cancel_gate = asyncio.Semaphore(64)

            async def cancel(w: Watch) -> None:
                async with cancel_gate:
                    await gateway.CancelTask(gateway_pb2.CancelTaskRequest(task_id=w.task_id), metadata=md, timeout=30)

            burst_from = time.time()
            await asyncio.gather(*(cancel(w) for w in chosen))
            cancelled_in = time.time() - burst_from
            if alive:  # a stream ends after its terminal event
                await asyncio.wait([followers[i] for i in alive], timeout=opts.burst_within)
            latencies = [w.terminal[1] - w.terminal[0] for w in chosen if w.terminal is not None]
            dropped_burst = _drops(watches, burst_from)
    finally:
        for w in watches:
            if w.ended is None:
                w.ended = "client"
                if w.call is not None:
                    w.call.cancel()
        for task in followers:
            task.cancel()
        await asyncio.gather(*followers, return_exceptions=True)
        for ch in channels:
            await ch.close()
        await stack.close_open_tasks()

    dropped = _drops(watches)
    never = sum(1 for w in watches if w.opened is None)
    report.add(section, f"WatchTask streams opened (of {opts.streams:,}, {len(channels)} channels)", opened, "streams",
               at_least=opts.streams, note=f"in {open_seconds:.1f} s; {never:,} never got their snapshot")
    report.add(section, "streams dropped by the server", sum(dropped.values()), "streams", at_most=0,
               note="; ".join(f"{n:,} {why}" for why, n in dropped.most_common(4)) or "none")
    per_stream = (rss_after - rss_before) / opened if opened else float("nan")
    report.add(section, "notifier RSS per open stream", per_stream / 1024, "KiB", at_most=16,
               note=f"RSS {rss_before / 2**20:.0f} -> {rss_after / 2**20:.0f} MiB")
    report.add(section, f"notifier CPU with {opened:,} idle streams", idle_cores, "cores", at_most=0.03,
               note=f"over {idle_seconds:g} s; {keepalives:,} keep-alives received; {baseline:.3f} cores before any "
               f"stream opened")
    p50, p99 = ms(latencies)
    report.add(section, f"burst: {len(chosen):,} watched tasks cancelled, terminal event -> its stream, p50", p50, "ms",
               note=f"{len(latencies):,} of {len(chosen):,} received within {opts.burst_within:g} s;"
                    f" cancels took {cancelled_in:.1f} s")
    report.add(section, "burst: terminal event -> its stream, p99", p99, "ms")
    report.raw["streams"] = {
        "streams": opts.streams, "channels": len(channels), "opened": opened, "open_s": round(open_seconds, 2),
        "never_opened": never, "dropped": dict(dropped), "dropped_while_opening": dict(dropped_opening),
        "dropped_while_idle": dict(dropped_idle), "dropped_in_burst": dict(dropped_burst),
        "rss_before_bytes": rss_before, "rss_after_bytes": rss_after, "idle_s": idle_seconds,
        "idle_cores": round(idle_cores, 4), "idle_cores_without_streams": round(baseline, 4),
        "keepalives_in_idle": keepalives, "burst": len(chosen),
        "burst_received": len(latencies), "burst_ms": {"p50": round(p50, 2), "p99": round(p99, 2)},
    }
