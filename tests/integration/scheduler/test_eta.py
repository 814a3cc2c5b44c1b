"""ETA beside the queue position, over real gRPC, PostgreSQL and NATS: GetTask, the WatchTask stream, progress
webhooks, the SDK's Task and the CLI's progress line; and the history query stays on its index on a big table."""

from __future__ import annotations

import asyncio
import io
from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import grpc
import pytest
from asyncpg.connection import LoggedQuery
from google.protobuf.timestamp_pb2 import Timestamp

from services.notifier import service as notifier_service
from services.submit import service as submit_service
from taskgate import auth, eta, store
from taskgate.config import Settings
from taskgate.runtime import Backends
from taskgate.states import Priority, Status
from taskgate.store import estimates, workers
from taskgate_api.v1 import events_pb2, events_pb2_grpc, gateway_pb2, gateway_pb2_grpc, task_pb2
from taskgate_client import connect_async
from taskgate_client.progress import ProgressBar
from taskgate_client.types import TaskEvent
from tests.support.factories import RESULT, claimed, finished_runs, insert_task, queued
from tests.support.harness import plan_nodes, wait_for
from tests.support.webhooks import WebhookReceiver

TENANT = "tenant-a"
BIGGER = {"num_frames": 17, "width": 64, "height": 64, "num_inference_steps": 2, "guidance_scale": 5.0, "fps": 8,
          "seed": 1, "negative_prompt": ""}  # another size class than the factory's 9 x 32 x 32


@dataclass
class Stack:
    """A submit service and a notifier over the test's backends, with the tenant's key."""

    backends: Backends
    submit: submit_service.SubmitHandle
    notifier: notifier_service.NotifierHandle
    api_key: str

    @property
    def pool(self) -> Any:
        return self.backends.pool

    @property
    def md(self) -> tuple[tuple[str, str]]:
        return (("authorization", f"Bearer {self.api_key}"),)

    async def get(self, task_id: int) -> task_pb2.Task:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{self.submit.port}") as channel:
            stub = gateway_pb2_grpc.TaskGatewayStub(channel)
            resp = await stub.GetTask(gateway_pb2.GetTaskRequest(task_id=str(task_id)), metadata=self.md, timeout=10)
        task: task_pb2.Task = resp.task
        return task


@pytest.fixture
async def stack(settings: Settings, backends: Backends) -> AsyncIterator[Stack]:
    settings = settings.model_copy(update={
        "webhook_schedule_seconds": [0.0, 0.2, 0.4], "webhook_scan_interval_seconds": 0.2,
        "relay_scan_interval_seconds": 0.2, "webhook_timeout_seconds": 2.0,
    })
    submit = await submit_service.start(settings, backends)
    notifier = await notifier_service.start(settings, backends)
    api_key, _secret = await auth.create_key(backends.pool, settings.api_key_pepper, TENANT)  # also the webhook secret
    try:
        yield Stack(backends, submit, notifier, api_key)
    finally:
        await notifier.stop()
        await submit.stop(0)






async def live_worker(pool: Any, slots: int, models: tuple[str, ...] = ("wan-tiny",)) -> None:
    """A registry row as a worker's heartbeat writes it (no worker runs: queued tasks stay queued)."""
    await workers.register(pool, workers.Registration("w-live", models, slots, 0, "cpu", False))


def at(ts: Timestamp) -> datetime:
    return ts.ToDatetime(tzinfo=UTC)


async def test_a_queued_tasks_eta_comes_from_history_and_grows_with_its_place_in_the_queue(stack: Stack) -> None:
    pool = stack.pool
    await live_worker(pool, slots=2)
    first, second = await queued(pool), await queued(pool)
    other_size = await queued(pool, params=BIGGER)
    unseen = await stack.get(first)
    assert unseen.queue_position == 1
    assert not unseen.HasField("estimated_start") and not unseen.HasField("estimated_finish")  # no history: no guess

    await finished_runs(pool, [8.0, 10.0, 12.0])  # median 10 s
    before = datetime.now(UTC)
    one, two = await stack.get(first), await stack.get(second)
    after = datetime.now(UTC)
    assert (one.queue_position, two.queue_position) == (1, 2)
    assert at(one.estimated_finish) - at(one.estimated_start) == timedelta(seconds=10)  # one run
    # position x run time / slots: 1 x 10 / 2 and 2 x 10 / 2 seconds from the moment each was answered
    assert (
        before + timedelta(seconds=5) - timedelta(seconds=1) <= at(one.estimated_start) <= after + timedelta(seconds=6)
    )
    assert at(two.estimated_start) - at(one.estimated_start) >= timedelta(seconds=5) - timedelta(milliseconds=1)
    assert at(two.estimated_finish) > at(one.estimated_finish)

    bigger = await stack.get(other_size)  # history of another size class says nothing about this one
    assert bigger.queue_position == 3 and not bigger.HasField("estimated_start")

    # the SDK's Task exposes them, and the CLI's progress line shows them
    async with connect_async(f"127.0.0.1:{stack.submit.port}", stack.api_key) as client:
        task = await client.get(str(second))
    assert task.estimated_start == at(task.proto.estimated_start) >= at(two.estimated_start)  # as of this later call
    assert task.estimated_finish == task.estimated_start + timedelta(seconds=10)
    out = io.StringIO()
    ProgressBar(out, tty=False).event(TaskEvent.from_snapshot(task.proto))
    assert "queue position 2, starts in ~" in out.getvalue() and ", done in ~" in out.getvalue(), out.getvalue()

    await workers.unregister(pool, "w-live")  # no live worker serves the model: no start time to give
    assert not (await stack.get(first)).HasField("estimated_start")


async def test_a_running_tasks_finish_comes_from_its_progress_and_history(stack: Stack) -> None:
    pool = stack.pool
    await finished_runs(pool, [20.0])
    task_id = await queued(pool)
    await claimed(pool, task_id, worker_id="w1", lease_seconds=30.0)
    assert (await store.apply(pool, task_id, store.Progress(percent=50, lease_seconds=30.0), actor="test")).applied
    before = datetime.now(UTC)
    task = await stack.get(task_id)
    after = datetime.now(UTC)
    assert task.status == task_pb2.TASK_STATUS_PROCESSING and not task.HasField("estimated_start")
    # half of a 20 s run is left
    assert before + timedelta(seconds=9) <= at(task.estimated_finish) <= after + timedelta(seconds=11)
    assert not (await stack.get(await queued(pool, model_id="sleepy"))).HasField("estimated_finish")  # no history


async def test_the_watch_stream_carries_the_eta_on_its_snapshot_and_events(stack: Stack) -> None:
    pool = stack.pool
    await live_worker(pool, slots=1)
    await finished_runs(pool, [10.0])
    task_id = await queued(pool)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{stack.notifier.port}") as channel:
        stub = events_pb2_grpc.TaskEventsStub(channel)
        call = stub.WatchTask(events_pb2.WatchTaskRequest(task_id=str(task_id)), metadata=stack.md)
        first = await asyncio.wait_for(call.read(), 10)
        assert first.WhichOneof("kind") == "snapshot"
        assert first.snapshot.queue_position == 1 and first.snapshot.HasField("estimated_start")
        assert at(first.snapshot.estimated_finish) - at(first.snapshot.estimated_start) == timedelta(seconds=10)
        await claimed(pool, task_id, worker_id="w1", lease_seconds=30.0)
        assert (await store.apply(pool, task_id, store.Progress(percent=40, lease_seconds=30.0), actor="test")).applied
        events: list[task_pb2.TaskEvent] = []
        async with asyncio.timeout(10):
            while not events or events[-1].progress != 40:
                msg = await call.read()
                if msg.WhichOneof("kind") == "event":
                    events.append(msg.event)
        call.cancel()
    assert all(e.to_status == task_pb2.TASK_STATUS_PROCESSING for e in events)
    assert not events[-1].HasField("estimated_start") and events[-1].HasField("estimated_finish")
    stream_event = TaskEvent.from_proto(events[-1])  # the SDK's event exposes it too
    assert stream_event.estimated_finish == at(events[-1].estimated_finish)


async def test_a_progress_webhook_carries_the_eta_and_a_final_one_does_not(stack: Stack) -> None:
    pool = stack.pool
    await finished_runs(pool, [10.0])
    async with WebhookReceiver() as rx:
        task = await insert_task(pool, callback_url=rx.url())
        await pool.execute("UPDATE task SET callback_events = '{PROGRESS}' WHERE id = $1", task.id)
        assert (await store.queue(pool, task.id, actor="test")).applied
        await claimed(pool, task.id, worker_id="w1", lease_seconds=30.0)
        assert (await store.apply(pool, task.id, store.Progress(percent=30, lease_seconds=30.0), actor="test")).applied
        await wait_for(lambda: any(r.json()["data"]["progress"] == 30 for r in rx.requests))
        assert (await store.apply(pool, task.id, store.Succeed(RESULT), actor="test")).applied
        await wait_for(lambda: any(r.json()["type"] == "task.succeeded" for r in rx.requests))
    bodies = [r.json() for r in rx.requests]
    running = next(b for b in bodies if b["data"]["progress"] == 30)
    assert running["type"] == "task.progress" and running["data"]["estimated_start"] is None
    finish = datetime.fromisoformat(running["data"]["estimated_finish"])
    assert finish > datetime.fromisoformat(running["data"]["event_at"])
    final = next(b for b in bodies if b["type"] == "task.succeeded")
    assert (final["data"]["estimated_start"], final["data"]["estimated_finish"]) == (None, None)
    assert all({"estimated_start", "estimated_finish"} <= b["data"].keys() for b in bodies)


def test_the_estimate_respects_the_models_cap_and_needs_a_live_slot() -> None:
    now = datetime(2030, 1, 1, tzinfo=UTC)
    inputs = estimates.EtaInputs(
        1, Status.QUEUED, 2, 0, "m", level_position=3, run_seconds=12.0, runs=5, slots=4, now=now
    )
    assert eta.estimate(inputs).start == now + timedelta(seconds=9)
    assert eta.estimate(inputs, cap=2).start == now + timedelta(seconds=18)  # only two run at once, whatever the slots
    idle = estimates.EtaInputs(
        1, Status.QUEUED, 2, 0, "m", level_position=3, run_seconds=12.0, runs=5, slots=0, now=now
    )
    assert eta.estimate(idle) == eta.Estimate(Status.QUEUED, 3)


def test_the_position_follows_the_workers_weighted_pick_not_strict_priority() -> None:
    now = datetime(2030, 1, 1, tzinfo=UTC)

    def low_task(level_position: int, high: int) -> eta.Estimate:
        inputs = estimates.EtaInputs(
            1, Status.QUEUED, 2, 0, "m", level_position=level_position, run_seconds=10.0, runs=5, slots=1, now=now,
            priority=Priority.LOW, queued={Priority.HIGH: high, Priority.LOW: level_position},
        )
        return eta.estimate(inputs)

    # HIGH:LOW 6:1: a LOW task takes one claim in seven while HIGH has tasks (the 4th, as the smooth pick spreads it)
    assert low_task(1, 20).queue_position == 4 and low_task(1, 20).start == now + timedelta(seconds=40)
    assert low_task(2, 20).queue_position == 11
    assert low_task(3, 2).queue_position == 5  # HIGH ran out: the rest of LOW follows at once
    assert low_task(1, 30_000).queue_position == 7  # a long queue: followed as rates (one claim in seven)


def test_a_chat_tasks_run_time_is_its_expected_tokens_times_the_seconds_per_token() -> None:
    now = datetime(2030, 1, 1, tzinfo=UTC)

    def chat_task(max_tokens: int, mean: float | None, per_token: float | None) -> eta.Estimate:
        inputs = estimates.EtaInputs(
            1, Status.QUEUED, 2, 0, "m", level_position=1, run_seconds=60.0, runs=5, slots=1, now=now,
            max_output_tokens=max_tokens, token_seconds=per_token, mean_output_tokens=mean,
        )
        return eta.estimate(inputs)

    def run(e: eta.Estimate) -> timedelta | None:
        return e.finish - e.start if e.finish is not None and e.start is not None else None

    assert run(chat_task(100, None, 0.05)) == timedelta(seconds=5)  # its max_output_tokens, not the 60 s median run
    assert run(chat_task(100, 40.0, 0.05)) == timedelta(seconds=2)  # answers end after 40 tokens on the mean
    assert run(chat_task(10, 40.0, 0.05)) == timedelta(seconds=0.5)  # never more than it may generate
    assert chat_task(100, None, None).start is None  # no run measured tokens: no guess
    def running(progress: int, mean: float | None) -> datetime | None:
        inputs = estimates.EtaInputs(
            1,
            Status.PROCESSING,
            2,
            progress,
            "m",
            level_position=0,
            run_seconds=60.0,
            runs=5,
            slots=0,
            now=now,
            max_output_tokens=100,
            token_seconds=0.05,
            mean_output_tokens=mean,
        )
        return eta.estimate(inputs).finish

    assert running(50, None) == now + timedelta(seconds=2.5)  # 50 of its 100 tokens generated: 50 x 0.05 s left
    assert running(10, 40.0) == now + timedelta(seconds=1.5)  # 10 of the 40 an answer takes on the mean: 30 left
    assert running(60, 40.0) == now + timedelta(seconds=2)  # longer than the mean already: up to its limit


CHAT = "chatty"


async def chat_runs(pool: Any, runs: list[tuple[float, int]]) -> None:
    """Successful chat runs of CHAT that took (seconds, output tokens) each."""
    for seconds, tokens in runs:
        task_id = await queued(pool, model_id=CHAT, task_type="chat", priority=Priority.LOW, params=chat_payload(256))
        await claimed(pool, task_id, worker_id="w-history", lease_seconds=30.0)
        answer = store.TextOutcome("x", 1, "length", 10, tokens)
        assert (await store.apply(pool, task_id, store.Succeed(RESULT, text=answer), actor="test")).applied
        await pool.execute(
            "UPDATE task SET started_at = finished_at - make_interval(secs => $2) WHERE id = $1", task_id, seconds
        )


def chat_payload(max_output_tokens: int) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": "hi"}], "max_output_tokens": max_output_tokens, "temperature": 0.0,
            "top_p": 1.0, "stop": [], "seed": 1, "input_tokens": 10}


async def test_a_queued_chat_tasks_eta_comes_from_the_measured_seconds_per_output_token(stack: Stack) -> None:
    pool = stack.pool
    await live_worker(pool, slots=1, models=(CHAT,))
    short = await queued(pool, model_id=CHAT, task_type="chat", params=chat_payload(50))
    long = await queued(pool, model_id=CHAT, task_type="chat", params=chat_payload(500))
    # 0.1, 0.2 and 0.15 s per token (median 0.15), 80 tokens on the mean; the median run (10 s) is not used
    await chat_runs(pool, [(10.0, 100), (20.0, 100), (6.0, 40)])
    one, two = await stack.get(short), await stack.get(long)
    assert at(one.estimated_finish) - at(one.estimated_start) == timedelta(seconds=50 * 0.15)  # its own max
    assert at(two.estimated_finish) - at(two.estimated_start) == timedelta(seconds=80 * 0.15)  # the mean answer
    # the streams' and webhooks' statement computes the same
    by_sql = await eta.estimates(pool, [short, long], stack.backends.settings)
    for task_id, seconds in ((short, 7.5), (long, 12.0)):
        e = by_sql[task_id]
        assert e.start is not None and e.finish is not None and e.finish - e.start == timedelta(seconds=seconds)


# 30k tasks, mostly finished, of two models and three size classes: the history query must read a few index entries.
BULK = """
INSERT INTO task (id, user_id, idempotency_key, request_hash, task_type, model_id, prompt, request_payload, priority,
                  queue_name, status, attempt, worker_id, lease_expires_at, started_at, queued_at, finished_at,
                  result_uri, result_sha256, result_size, created_at, updated_at)
SELECT i, 'tenant-' || (i % 50), 'k-' || i, md5(i::text), 'text-to-video', m,
       'p', jsonb_build_object('num_frames', 9 + 8 * (i % 3), 'width', 32, 'height', 32), 5, m || '.5', s::task_status,
       CASE WHEN s IN ('PROCESSING', 'SUCCEEDED') THEN 1 ELSE 0 END,
       CASE WHEN s = 'PROCESSING' THEN 'w' || (i % 7) END,
       CASE WHEN s = 'PROCESSING' THEN now() + interval '30 seconds' END,
       CASE WHEN s IN ('PROCESSING', 'SUCCEEDED') THEN t - interval '10 seconds' END,
       t - interval '20 seconds',
       CASE WHEN s = 'SUCCEEDED' THEN t END,
       CASE WHEN s = 'SUCCEEDED' THEN 'mem://' || i END,
       CASE WHEN s = 'SUCCEEDED' THEN md5(i::text) END,
       CASE WHEN s = 'SUCCEEDED' THEN 1000 END,
       t, t
FROM (
    SELECT i, CASE WHEN i % 2 = 0 THEN 'wan-tiny' ELSE 'sleepy' END AS m,
           CASE WHEN i % 100 < 95 THEN 'SUCCEEDED' WHEN i % 100 < 98 THEN 'QUEUED' ELSE 'PROCESSING' END AS s,
           now() - make_interval(secs => (i % 7200)) AS t
    FROM generate_series(1, 30000) AS i
) g
"""


async def test_the_eta_query_reads_the_history_index_on_a_big_table(backends: Backends) -> None:
    async with backends.pool.acquire() as conn:
        await conn.execute("ALTER TABLE task DISABLE TRIGGER task_event_on_insert")  # no history for fixture rows
        await conn.execute(BULK)
        await conn.execute("ALTER TABLE task ENABLE TRIGGER task_event_on_insert")
        await conn.execute("ANALYZE task")
        await live_worker(conn, slots=3, models=("wan-tiny", "sleepy"))
        ids = [196, 198, 1096, 99]  # QUEUED and PROCESSING tasks of both models
        found = await estimates.eta_inputs(conn, ids, window_seconds=86400.0, max_runs=20, alive_seconds=10.0)
        assert {i: (f.status, f.runs, f.run_seconds) for i, f in found.items()} == {
            196: (Status.QUEUED, 20, 10.0), 198: (Status.PROCESSING, 20, 10.0), 1096: (Status.QUEUED, 20, 10.0),
            99: (Status.PROCESSING, 20, 10.0),
        }
        assert found[196].slots == 1.5 and found[198].slots == 0  # 3 slots shared by two models, each with a backlog
        logged: asyncio.Queue[LoggedQuery] = asyncio.Queue()
        with conn.query_logger(logged.put_nowait):
            await estimates.eta_inputs(conn, ids, window_seconds=86400.0, max_runs=20, alive_seconds=10.0)
        ran = await asyncio.wait_for(logged.get(), 5)
        assert logged.empty()  # one statement: the one explained
        [explained] = await conn.fetchval(f"EXPLAIN (FORMAT JSON) {ran.query}", *ran.args)
    nodes = plan_nodes(explained["Plan"])
    on_task = [(n["Node Type"], n.get("Index Name")) for n in nodes
               if n.get("Relation Name") == "task" or n.get("Index Name", "").startswith("task_")]
    assert on_task and not any(kind == "Seq Scan" for kind, _ in on_task), on_task
    assert any(index == "task_recent_runs_idx" for _, index in on_task), on_task

