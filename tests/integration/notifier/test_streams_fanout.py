"""TaskEvents fan-out against real PostgreSQL, NATS and gRPC: one ETA read per event however many streams watch it,
one keep-alive timer per process however many streams idle, and no stream ended without a status and a reason."""

from __future__ import annotations

import asyncio
from collections import Counter
from typing import Any

import grpc
import pytest
from google.rpc import error_details_pb2

from services.notifier.shared_reads import Estimates
from taskgate.config import Settings
from taskgate.runtime import Backends
from taskgate.states import Status
from taskgate_api.v1 import events_pb2, events_pb2_grpc
from tests.support.factories import finished_runs, insert_task
from tests.support.harness import bearer, error_info, trailing_details, wait_for
from tests.support.notifier import all_relayed, events_stub, fast, progress, run_to, succeed

STREAMS = 20


class EtaReads:
    """Counts the live events' ETA reads of the notifier (Estimates._read_many is their one path) and what each
    covered."""

    def __init__(self) -> None:
        self.calls: list[list[tuple[int, Status]]] = []
        self._original = Estimates._read_many

    async def __call__(self, estimates: Estimates, seen: list[tuple[int, Status]]) -> Any:
        self.calls.append(list(seen))
        return await self._original(estimates, seen)


@pytest.fixture
def eta_reads(monkeypatch: pytest.MonkeyPatch) -> EtaReads:
    reads = EtaReads()

    async def counted(estimates: Estimates, seen: list[tuple[int, Status]]) -> Any:
        return await reads(estimates, seen)

    monkeypatch.setattr(Estimates, "_read_many", counted)
    return reads


async def next_event(call: Any) -> Any:
    """The next event of a stream, past its keep-alives."""
    while True:
        msg = await call.read()
        assert msg is not grpc.aio.EOF, "the stream ended early"
        if msg.WhichOneof("kind") == "event":
            return msg.event


async def test_each_live_event_costs_one_eta_read_however_many_streams_watch_it(
    backends: Backends, settings: Settings, api_key: str, notifier_factory: Any, eta_reads: EtaReads
) -> None:
    handle = await notifier_factory(fast(settings))
    pool = backends.pool
    await finished_runs(pool, [4.0, 6.0])  # recent runs of the model: an ETA exists
    task = await insert_task(pool)
    await run_to(pool, task.id, Status.PROCESSING)
    async with events_stub(handle) as stub:
        calls = [
            stub.WatchTask(events_pb2.WatchTaskRequest(task_id=str(task.id)), metadata=bearer(api_key))
            for _ in range(STREAMS)
        ]
        snapshots = [await call.read() for call in calls]
        assert all(s.snapshot.version == 3 and s.snapshot.HasField("estimated_finish") for s in snapshots)
        assert len(eta_reads.calls) <= STREAMS  # opening: at most one each (concurrent ones share)
        before = len(eta_reads.calls)
        for step, percent in enumerate((20, 40, 60), start=1):
            await progress(pool, task.id, percent)
            got = await asyncio.wait_for(asyncio.gather(*(next_event(call) for call in calls)), 10)
            assert {(e.version, e.progress) for e in got} == {(3 + step, percent)}
            assert all(e.HasField("estimated_finish") for e in got)  # every stream's event carries the ETA
            assert len(eta_reads.calls) - before == step, "one ETA read per event, not one per stream"
        await succeed(pool, task.id)
        ends = await asyncio.wait_for(asyncio.gather(*(next_event(call) for call in calls)), 10)
        assert {e.version for e in ends} == {7} and not any(e.HasField("estimated_finish") for e in ends)
        assert len(eta_reads.calls) - before == 3  # a terminal event needs none
        assert [await call.read() for call in calls] == [grpc.aio.EOF] * STREAMS


def timers() -> Counter[str]:
    """The live timers of this event loop by callback (asyncio's own heap: a per-stream timeout would show up here),
    asyncpg's own (its statement cache and idle connections, per statement or connection) left out."""
    live = (t for t in asyncio.get_running_loop()._scheduled if not t.cancelled())  # type: ignore[attr-defined]
    names = (getattr(getattr(t, "_callback", None), "__qualname__", "?") for t in live)
    return Counter(n for n in names if not n.startswith(("_StatementCache.", "PoolConnectionHolder.")))


async def test_idle_streams_share_one_keepalive_timer_and_each_still_gets_its_keepalives(
    backends: Backends, settings: Settings, api_key: str, notifier_factory: Any
) -> None:
    handle = await notifier_factory(fast(settings, stream_keepalive_seconds=0.4))
    tasks = [await insert_task(backends.pool) for _ in range(STREAMS)]
    await all_relayed(backends.pool)  # their CREATED events relayed before the streams open: only keep-alives follow
    async with events_stub(handle) as stub:
        idle = timers().total()
        assert timers()["Keepalive._tick"] == 0
        watches = [
            stub.WatchTask(events_pb2.WatchTaskRequest(task_id=str(t.id)), metadata=bearer(api_key)) for t in tasks
        ] + [stub.WatchTasks(events_pb2.WatchTasksRequest(), metadata=bearer(api_key)) for _ in range(STREAMS)]
        firsts = [await call.read() for call in watches]  # a snapshot, or WatchTasks' caught-up keep-alive
        assert [m.WhichOneof("kind") for m in firsts] == ["snapshot"] * STREAMS + ["keepalive"] * STREAMS
        for _ in range(2):  # every stream gets its keep-alives; the loop holds one tick for all 40, no timer each
            now = timers()
            # one tick, plus whatever the background loops wait on at this moment: nothing near one per stream (40)
            assert now["Keepalive._tick"] == 1 and now.total() - idle < STREAMS // 4, (idle, now)
            got = await asyncio.wait_for(asyncio.gather(*(call.read() for call in watches)), 10)
            assert Counter(m.WhichOneof("kind") for m in got) == {"keepalive": 2 * STREAMS}
        for call in watches:
            call.cancel()
        await wait_for(lambda: handle.hub.subscribers == 0)
    assert timers()["Keepalive._tick"] == 0  # the tick stops with the last stream


def retry_delay(exc: grpc.aio.AioRpcError) -> float | None:
    for detail in trailing_details(exc):
        if isinstance(detail, error_details_pb2.RetryInfo):
            return float(detail.retry_delay.ToMilliseconds()) / 1000
    return None


async def test_a_notifier_shutting_down_ends_every_stream_with_a_status_and_where_to_resume(
    backends: Backends, settings: Settings, api_key: str, notifier_factory: Any
) -> None:
    handle = await notifier_factory(fast(settings))
    pool = backends.pool
    task = await insert_task(pool)
    await run_to(pool, task.id, Status.PROCESSING, [30])
    await all_relayed(pool)
    async with events_stub(handle) as stub:
        one = stub.WatchTask(events_pb2.WatchTaskRequest(task_id=str(task.id)), metadata=bearer(api_key))
        assert (await one.read()).snapshot.version == 4
        every = stub.WatchTasks(events_pb2.WatchTasksRequest(), metadata=bearer(api_key))
        cursor = (await every.read()).cursor
        stopping = asyncio.create_task(handle.stop())
        for call, field in ((one, "last_version"), (every, "cursor")):
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                async with asyncio.timeout(10):
                    while (msg := await call.read()) is not grpc.aio.EOF:
                        cursor = msg.cursor or cursor
            assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
            info = error_info(caught.value)
            assert info.reason == "NOTIFIER_SHUTTING_DOWN"
            assert info.metadata[field] == ("4" if call is one else cursor)
            assert retry_delay(caught.value) is not None
        await stopping


async def test_two_thousand_streams_opened_at_once_all_open(
    backends: Backends, settings: Settings, api_key: str, notifier_factory: Any
) -> None:
    """gRPC core cancelled some (a bare CANCELLED, no handler ran) when over 1,000 calls waited for the event loop."""
    handle = await notifier_factory(fast(settings, max_streams_per_tenant=2000, tenant_calls_per_second=0.0))
    tasks = [await insert_task(backends.pool) for _ in range(20)]
    ends: Counter[str] = Counter()
    async with grpc.aio.insecure_channel(f"127.0.0.1:{handle.port}") as channel:
        stub = events_pb2_grpc.TaskEventsStub(channel)

        async def open_one(i: int) -> None:
            call = stub.WatchTask(
                events_pb2.WatchTaskRequest(task_id=str(tasks[i % len(tasks)].id)), metadata=bearer(api_key)
            )
            try:
                ends[(await call.read()).WhichOneof("kind") or "?"] += 1
            except grpc.aio.AioRpcError as exc:
                ends[f"{exc.code().name}: {exc.details()}"] += 1
            finally:
                call.cancel()

        await asyncio.wait_for(asyncio.gather(*(open_one(i) for i in range(2000))), 120)
    assert ends == {"snapshot": 2000}


async def test_a_stream_outliving_its_connections_age_ends_with_a_status_and_where_to_resume(
    backends: Backends, settings: Settings, api_key: str, notifier_factory: Any
) -> None:
    """The server closes a connection at its maximum age and cuts off, after the grace, what still runs on it: a
    stream ends itself first, UNAVAILABLE with STREAM_MAX_AGE and its resume point (it used to end with no status)."""
    aging = fast(settings, grpc_max_connection_age_seconds=1.0, grpc_max_connection_age_grace_seconds=0.5,
                 stream_max_age_seconds=2.0, stream_keepalive_seconds=0.2)
    handle = await notifier_factory(aging)
    pool = backends.pool
    task = await insert_task(pool)
    await run_to(pool, task.id, Status.PROCESSING, [30])
    await all_relayed(pool)
    async with events_stub(handle) as stub:
        one = stub.WatchTask(events_pb2.WatchTaskRequest(task_id=str(task.id)), metadata=bearer(api_key))
        every = stub.WatchTasks(events_pb2.WatchTasksRequest(), metadata=bearer(api_key))
        cursor = ""
        for call, field in ((one, "last_version"), (every, "cursor")):
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                async with asyncio.timeout(15):
                    while (msg := await call.read()) is not grpc.aio.EOF:
                        cursor = getattr(msg, "cursor", "") or cursor
            assert caught.value.code() == grpc.StatusCode.UNAVAILABLE, caught.value
            info = error_info(caught.value)
            assert info.reason == "STREAM_MAX_AGE", caught.value
            assert info.metadata[field] == ("4" if call is one else cursor)
            assert retry_delay(caught.value) is not None
        resumed = stub.WatchTask(
            events_pb2.WatchTaskRequest(task_id=str(task.id), after_version=4), metadata=bearer(api_key)
        )
        assert (await resumed.read()).WhichOneof("kind") in ("snapshot", "keepalive")
        resumed.cancel()
