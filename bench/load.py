"""The load client: runs in its own (spawned) process and drives SubmitTask, SubmitTasks or GetTask at a fixed
concurrency."""

from __future__ import annotations

import asyncio
import os
import time
from collections import Counter
from dataclasses import dataclass, field

import grpc

from taskgate_api.v1 import gateway_pb2, gateway_pb2_grpc, task_pb2


@dataclass(frozen=True)
class LoadSpec:
    """What one load run does: `method` is 'submit', 'submit_many' (`batch` tasks per call), 'get', or 'sdk' (the SDK's
    submit() from one client, over its SubmitStream when `stream`, else unary SubmitTask); `ids` are the tasks 'get'
    reads, in turn."""

    address: str
    api_key: str
    method: str
    concurrency: int
    seconds: float
    warmup: float = 0.5
    channels: int = 8
    model: str = "sleepy"
    tag: str = "bench"
    ids: tuple[str, ...] = ()
    keep_ids: int = 20_000
    extra_keys: tuple[str, ...] = ()  # more tenants' keys: caller i uses key i mod (1 + len(extra_keys))
    batch: int = 1
    stream: bool = True


@dataclass(frozen=True)
class Window:
    """The measured interval of a closed-loop load run, one rule for taskgate and every peer.

    Callers start calls until the window closes (`open`), so the load is the same all through it; a call counts (its
    tasks, its latency, its error) when it ended inside the window (`counts`), whenever it started: a completion rate
    over the window, which neither loses the long calls that straddle its start (bulk) nor favours the short ones."""

    start: float  # time.perf_counter() values
    end: float

    @classmethod
    def after(cls, warmup: float, seconds: float) -> Window:
        """The window that opens `warmup` seconds from now and lasts `seconds`."""
        start = time.perf_counter() + warmup
        return cls(start, start + seconds)

    @property
    def seconds(self) -> float:
        return self.end - self.start

    def open(self, now: float) -> bool:
        """Whether a caller may start another call at `now`."""
        return now < self.end

    def counts(self, ended: float) -> bool:
        """Whether a call that ended at `ended` is measured."""
        return self.start <= ended <= self.end


@dataclass
class LoadResult:
    """Calls that ended inside the measured window (Window.counts), their latencies (seconds), errors by code, created
    task ids.

    For 'submit_many', `ok` and `total` count tasks (so `rate` is tasks/s), `latencies` calls, `errors` items."""

    ok: int = 0
    total: int = 0  # every completed call, warm-up and tail included (for CPU per call)
    created: int = 0  # tasks created by the run, warm-up and tail included
    cpu: float = 0.0  # the client process's CPU seconds
    elapsed: float = 0.0
    latencies: list[float] = field(default_factory=list)
    errors: Counter[str] = field(default_factory=Counter)
    ids: list[str] = field(default_factory=list)

    @property
    def rate(self) -> float:
        return self.ok / self.elapsed if self.elapsed else 0.0


def run_load(spec: LoadSpec) -> LoadResult:
    """Entry point in the client process."""
    return asyncio.run(_run_sdk(spec) if spec.method == "sdk" else _run(spec))


async def _run_sdk(spec: LoadSpec) -> LoadResult:
    """`spec.concurrency` coroutines calling submit() of one AsyncTaskgateClient (one channel: what an application
    holds), measured by the same Window rule."""
    from taskgate_client import TaskgateError, connect_async

    result = LoadResult()
    pid = os.getpid()
    counter = iter(range(10**9))
    async with connect_async(spec.address, spec.api_key, submit_stream=spec.stream, retry_attempts=1) as client:
        await client.submit(f"{spec.tag} warm", spec.model, steps=1, idempotency_key=f"{spec.tag}-{pid}-warm")
        cpu_start = time.process_time()
        window = Window.after(spec.warmup, spec.seconds)

        async def one() -> None:
            while True:
                n = next(counter)
                began = time.perf_counter()
                if not window.open(began):
                    return
                try:
                    handle = await client.submit(
                        f"{spec.tag} task {n}", spec.model, steps=1, idempotency_key=f"{spec.tag}-{pid}-{n}"
                    )
                except TaskgateError as exc:
                    if window.counts(time.perf_counter()):
                        result.errors[exc.code.name] += 1
                    continue
                ended = time.perf_counter()
                result.total += 1
                result.created += bool(handle.created)
                if window.counts(ended):
                    result.ok += 1
                    result.latencies.append(ended - began)

        await asyncio.gather(*(one() for _ in range(spec.concurrency)))
        result.elapsed = window.seconds
        result.cpu = time.process_time() - cpu_start
    return result


async def _run(spec: LoadSpec) -> LoadResult:
    # One HTTP/2 connection per channel (no shared subchannel pool), so the kernel spreads them over the
    # server processes that share the port with SO_REUSEPORT.
    options = [("grpc.use_local_subchannel_pool", 1)]
    channels = [grpc.aio.insecure_channel(spec.address, options=options) for _ in range(max(1, spec.channels))]
    stubs = [gateway_pb2_grpc.TaskGatewayStub(ch) for ch in channels]
    keys = (spec.api_key, *spec.extra_keys)
    mds = [(("authorization", f"Bearer {key}"),) for key in keys]
    for ch in channels:
        await ch.channel_ready()
    result = LoadResult()
    cpu_start = time.process_time()
    window = Window.after(spec.warmup, spec.seconds)
    counter = iter(range(10**9))
    pid = os.getpid()
    params = task_pb2.VideoParams(num_inference_steps=1)

    async def one(stub: gateway_pb2_grpc.TaskGatewayStub, md: tuple[tuple[str, str], ...]) -> None:
        while True:
            n = next(counter)
            began = time.perf_counter()
            if not window.open(began):
                return
            tasks = 1
            try:
                if spec.method == "submit":
                    request = gateway_pb2.SubmitTaskRequest(
                        prompt=f"{spec.tag} task {n}", model_id=spec.model, params=params,
                        idempotency_key=f"{spec.tag}-{pid}-{n}",
                    )
                    resp = await stub.SubmitTask(request, metadata=md, timeout=30)
                    ended = time.perf_counter()
                    result.created += resp.created
                    if len(result.ids) < spec.keep_ids:
                        result.ids.append(resp.task.id)
                elif spec.method == "submit_many":
                    many = await stub.SubmitTasks(_batch(spec, pid, n, params), metadata=md, timeout=60)
                    ended = time.perf_counter()
                    tasks = _record_batch(spec, many, result, counted=window.counts(ended))
                else:
                    task_id = spec.ids[n % len(spec.ids)]
                    await stub.GetTask(gateway_pb2.GetTaskRequest(task_id=task_id), metadata=md, timeout=30)
                    ended = time.perf_counter()
            except grpc.aio.AioRpcError as exc:
                if window.counts(time.perf_counter()):
                    result.errors[exc.code().name] += 1
                continue
            result.total += tasks
            if window.counts(ended):
                result.ok += tasks
                result.latencies.append(ended - began)

    await asyncio.gather(*(one(stubs[i % len(stubs)], mds[i % len(mds)]) for i in range(spec.concurrency)))
    result.elapsed = window.seconds
    result.cpu = time.process_time() - cpu_start
    for ch in channels:
        await ch.close()
    return result


_CODE_NAMES = {code.value[0]: code.name for code in grpc.StatusCode}


def _batch(spec: LoadSpec, pid: int, n: int, params: task_pb2.VideoParams) -> gateway_pb2.SubmitTasksRequest:
    """Call `n`'s SubmitTasks request: `spec.batch` tasks, each with its own idempotency key."""
    return gateway_pb2.SubmitTasksRequest(requests=[
        gateway_pb2.SubmitTaskRequest(prompt=f"{spec.tag} task {n}.{i}", model_id=spec.model, params=params,
                                      idempotency_key=f"{spec.tag}-{pid}-{n}.{i}")
        for i in range(spec.batch)
    ])


def _record_batch(
    spec: LoadSpec, response: gateway_pb2.SubmitTasksResponse, result: LoadResult, *, counted: bool
) -> int:
    """Records one SubmitTasks answer (created ids, per-item errors); returns how many of its tasks were admitted."""
    admitted = 0
    for item in response.results:
        if item.HasField("error"):
            if counted:
                result.errors[_CODE_NAMES.get(item.error.code, str(item.error.code))] += 1
            continue
        admitted += 1
        result.created += item.response.created
        if item.response.created and len(result.ids) < spec.keep_ids:
            result.ids.append(item.response.task.id)
    return admitted
