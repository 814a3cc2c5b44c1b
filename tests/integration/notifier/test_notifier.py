"""Notifier: the event relay, the webhook outbox and its HTTP behaviour, the TaskEvents streams (real PG, NATS, HTTP,
gRPC)."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Sequence
from typing import Any

import grpc
import nats.js.errors
import pytest

from services.notifier.relay import EventRelay, TestSignals
from taskgate import auth, store
from taskgate import bus as busmod
from taskgate.config import Settings
from taskgate.runtime import Backends
from taskgate.states import CALLBACK_LEGAL, CallbackStatus, Status
from taskgate.store import webhooks as outbox_store
from taskgate_api.v1 import events_pb2, task_pb2
from tests.support.factories import RESULT, claimed, insert_task
from tests.support.harness import bearer, error_info, wait_for
from tests.support.notifier import _eq, all_relayed, events_stub, fast, independent_signature, progress, run_to, succeed
from tests.support.webhooks import Reply, WebhookReceiver

# ---------------------------------------------------------------- helpers











async def delivery(pool: Any, task_id: int) -> Any:
    return await pool.fetchrow(
        "SELECT * FROM callback_delivery WHERE task_id = $1 AND event_type <> 'task.progress'", task_id
    )




async def stream_events(backends: Backends) -> list[task_pb2.TaskEvent]:
    """Every message on the TASK_EVENTS stream, in stream order."""
    info = await backends.bus.js.stream_info(busmod.EVENTS_STREAM)
    out: list[task_pb2.TaskEvent] = []
    if not info.state.messages:
        return out
    for seq in range(info.state.first_seq, info.state.last_seq + 1):
        msg = await backends.bus.js.get_msg(busmod.EVENTS_STREAM, seq)
        assert msg.data is not None
        out.append(task_pb2.TaskEvent.FromString(msg.data))
    return out


# ---------------------------------------------------------------- pure logic






# ---------------------------------------------------------------- webhooks


async def test_failing_receiver_gets_same_webhook_id_with_growing_delays_and_valid_signature(
    backends: Backends, settings: Settings, secret: str, notifier_factory: Any
) -> None:
    async with WebhookReceiver(lambda r: Reply(500, body=b"busy") if r.index < 2 else Reply(204, body=b"")) as rx:
        await notifier_factory(fast(settings))
        task = await insert_task(backends.pool, callback_url=rx.url())
        await run_to(backends.pool, task.id, Status.SUCCEEDED, [50])
        await wait_for(lambda: len(rx.requests) == 3)
        await wait_for(
            lambda: _eq(backends.pool.fetchval("SELECT callback_status FROM task WHERE id = $1", task.id), "DELIVERED")
        )

    assert set(rx.ids()) == {f"msg_{task.id}_5"}  # CREATED, QUEUED, PROCESSING, 50 %, SUCCEEDED
    first_gap = rx.requests[1].at - rx.requests[0].at
    second_gap = rx.requests[2].at - rx.requests[1].at
    # Never before the scheduled delay (0.2 s, then 0.4 s, less 5 % jitter); generous upper bounds for a busy machine.
    assert 0.18 <= first_gap < 1.5, first_gap
    assert 0.37 <= second_gap < 2.0, second_gap
    for request in rx.requests:
        assert request.headers["webhook-signature"] == independent_signature(secret, request)
        assert abs(int(request.headers["webhook-timestamp"]) - time.time()) < 60
        assert request.headers["content-type"] == "application/json"
    body = json.loads(rx.requests[-1].body)
    assert body["type"] == "task.succeeded"
    data = body["data"]
    assert data["task_id"] == str(task.id) and data["status"] == "SUCCEEDED" and data["version"] == 5
    assert data["result"] == {"uri": "nats-os://taskgate-results/x.mp4", "size": 1234, "sha256": RESULT.sha256,
                              "content_type": "video/mp4", "reused": False}
    assert data["error"] is None and data["finished_at"] and data["created_at"] and data["started_at"]

    row = await delivery(backends.pool, task.id)
    assert row["status"] == "DELIVERED" and row["attempts"] == 3 and row["last_status_code"] == 204
    attempts = await backends.pool.fetch(
        "SELECT * FROM callback_attempt WHERE delivery_id = $1 ORDER BY attempt", row["id"]
    )
    assert [a["attempt"] for a in attempts] == [1, 2, 3]
    assert [a["status_code"] for a in attempts] == [500, 500, 204]
    assert {a["webhook_id"] for a in attempts} == {f"msg_{task.id}_5"}
    assert "busy" in attempts[0]["error"] and attempts[2]["error"] is None
    assert all(a["latency_ms"] >= 0 for a in attempts)






async def test_hanging_receiver_is_cut_at_the_timeout(
    backends: Backends, settings: Settings, secret: str, notifier_factory: Any
) -> None:
    async with WebhookReceiver(lambda _r: Reply(None)) as rx:
        await notifier_factory(fast(settings, webhook_timeout_seconds=0.3, webhook_schedule_seconds=[0.0]))
        task = await insert_task(backends.pool, callback_url=rx.url())
        await run_to(backends.pool, task.id, Status.FAILED)
        await wait_for(lambda: _eq(_status(backends, task.id), "FAILED"), within=15)
    row = await delivery(backends.pool, task.id)
    attempt = await backends.pool.fetchrow("SELECT * FROM callback_attempt WHERE delivery_id = $1", row["id"])
    assert len(rx.requests) == 1 and row["attempts"] == 1
    assert attempt["status_code"] is None and "timeout" in attempt["error"]
    assert 250 <= attempt["latency_ms"] < 5000, attempt["latency_ms"]  # cut at 0.3 s; the receiver never answers
    assert json.loads(rx.requests[0].body)["data"]["error"] == {"code": "MODEL_ERROR", "message": "the model fell over"}
    assert await backends.pool.fetchval("SELECT callback_status FROM task WHERE id = $1", task.id) == "FAILED"


async def _status(backends: Backends, task_id: int) -> str | None:
    row = await delivery(backends.pool, task_id)
    return None if row is None else str(row["status"])


async def test_gone_stops_retries_at_once(
    backends: Backends, settings: Settings, secret: str, notifier_factory: Any
) -> None:
    async with WebhookReceiver(lambda _r: Reply(410, body=b"unsubscribed")) as rx:
        await notifier_factory(fast(settings, webhook_schedule_seconds=[0.0, 0.05, 0.05]))
        task = await insert_task(backends.pool, callback_url=rx.url())
        await run_to(backends.pool, task.id, Status.SUCCEEDED)
        await wait_for(lambda: _eq(_status(backends, task.id), "FAILED"))  # final: no retry is scheduled
    assert len(rx.requests) == 1
    row = await delivery(backends.pool, task.id)
    assert row["attempts"] == 1 and row["last_status_code"] == 410


async def test_redirect_is_not_followed_and_counts_as_failure(
    backends: Backends, settings: Settings, secret: str, notifier_factory: Any
) -> None:
    async with WebhookReceiver(host="127.0.0.2") as private, WebhookReceiver(
        lambda _n: Reply(302, headers={"location": private.url()})
    ) as rx:
        await notifier_factory(fast(settings, webhook_schedule_seconds=[0.0, 0.05]))
        task = await insert_task(backends.pool, callback_url=rx.url())
        await run_to(backends.pool, task.id, Status.SUCCEEDED)
        await wait_for(lambda: _eq(_status(backends, task.id), "FAILED"))
    assert len(rx.requests) == 2 and private.requests == []
    row = await delivery(backends.pool, task.id)
    assert row["last_status_code"] == 302 and private.url() in row["last_error"]


async def test_private_address_is_refused_at_send_time(
    backends: Backends, settings: Settings, secret: str, notifier_factory: Any
) -> None:
    async with WebhookReceiver(host="127.0.0.2") as private:
        await notifier_factory(fast(settings, webhook_schedule_seconds=[0.0, 0.05]))
        task = await insert_task(backends.pool, callback_url=private.url())  # 127.0.0.2 is not allow-listed
        await run_to(backends.pool, task.id, Status.SUCCEEDED)
        await wait_for(lambda: _eq(_status(backends, task.id), "FAILED"))
    assert private.requests == []
    row = await delivery(backends.pool, task.id)
    assert row["attempts"] == 2 and row["last_status_code"] is None and row["last_error"].startswith("blocked")


async def test_cancel_sends_a_webhook_only_when_asked_and_progress_only_with_the_filter(
    backends: Backends, settings: Settings, secret: str, notifier_factory: Any
) -> None:
    async with WebhookReceiver() as rx:
        await notifier_factory(fast(settings))
        quiet = await insert_task(backends.pool, callback_url=rx.url())
        asked = await insert_task(backends.pool, callback_url=rx.url())
        await backends.pool.execute(
            "UPDATE task SET callback_events = '{CANCELED,PROGRESS}' WHERE id = $1", asked.id
        )
        await run_to(backends.pool, quiet.id, Status.CANCELED, [30])
        await run_to(backends.pool, asked.id, Status.PROCESSING, [30])
        # a waiting progress webhook gives way to a newer event's: cancel once the 30 % one went out
        await wait_for(lambda: any(json.loads(r.body)["data"]["progress"] == 30 for r in rx.requests))
        assert (await store.apply(backends.pool, asked.id, store.Cancel(store.CancelMode.SOFT), actor="test")).applied
        await wait_for(lambda: _eq(_status(backends, asked.id), "DELIVERED"))
        await all_relayed(backends.pool)
    assert await delivery(backends.pool, quiet.id) is None
    assert await backends.pool.fetchval("SELECT callback_status FROM task WHERE id = $1", quiet.id) == "NONE"
    assert await backends.pool.fetchval("SELECT callback_status FROM task WHERE id = $1", asked.id) == "DELIVERED"
    bodies = [json.loads(r.body) for r in rx.requests]
    assert [b["type"] for b in bodies].count("task.canceled") == 1
    progress = [b["data"]["progress"] for b in bodies if b["type"] == "task.progress"]
    assert 30 in progress and set(progress) <= {0, 30}  # the claim's (unless the 30 % one superseded it) and 30 %
    assert all(b["data"]["task_id"] == str(asked.id) for b in bodies)


async def test_redeliver_sends_again_with_the_same_webhook_id(
    backends: Backends, settings: Settings, secret: str, notifier_factory: Any
) -> None:
    async with WebhookReceiver() as rx:
        await notifier_factory(fast(settings))
        task = await insert_task(backends.pool, callback_url=rx.url())
        await run_to(backends.pool, task.id, Status.SUCCEEDED)
        await wait_for(lambda: _eq(_status(backends, task.id), "DELIVERED"))
        again = await outbox_store.redeliver(backends.pool, task.id)
        assert [(r.webhook_id, r.status, r.event_type) for r in again] == [
            (f"msg_{task.id}_4", CallbackStatus.PENDING, "task.succeeded")
        ]
        await wait_for(lambda: len(rx.requests) == 2)
        await wait_for(lambda: _eq(_status(backends, task.id), "DELIVERED"))
    assert rx.ids() == [f"msg_{task.id}_4"] * 2
    attempts = await backends.pool.fetch(
        "SELECT a.attempt FROM callback_attempt a JOIN callback_delivery d ON d.id = a.delivery_id WHERE d.task_id = $1"
        " ORDER BY a.attempt",
        task.id,
    )
    assert [a["attempt"] for a in attempts] == [1, 2]
    assert await outbox_store.redeliver(backends.pool, 1) == []  # no such task, nothing to do


async def test_redeliver_after_the_schedule_ran_out_starts_a_new_round(
    backends: Backends, settings: Settings, secret: str, notifier_factory: Any
) -> None:
    big = b"x" * 200_000  # far past webhook_max_response_bytes: read no further than the cap
    async with WebhookReceiver(lambda r: Reply(503, body=big) if r.index == 0 else Reply(200)) as rx:
        await notifier_factory(fast(settings, webhook_schedule_seconds=[0.0], webhook_max_response_bytes=64))
        task = await insert_task(backends.pool, callback_url=rx.url())
        await run_to(backends.pool, task.id, Status.TIMEOUT)
        await wait_for(lambda: _eq(_status(backends, task.id), "FAILED"))
        row = await delivery(backends.pool, task.id)
        assert row["attempts"] == 1 and len(row["last_error"]) <= 300 and row["last_error"].startswith("HTTP 503")
        assert await backends.pool.fetchval("SELECT callback_status FROM task WHERE id = $1", task.id) == "FAILED"
        assert len(await outbox_store.redeliver(backends.pool, task.id)) == 1
        await wait_for(lambda: _eq(_status(backends, task.id), "DELIVERED"))
    row = await delivery(backends.pool, task.id)
    assert (row["attempts"], row["round_start"], row["event_type"]) == (2, 1, "task.timeout")
    assert rx.ids() == [row["webhook_id"]] * 2
    assert await backends.pool.fetchval("SELECT callback_status FROM task WHERE id = $1", task.id) == "DELIVERED"


async def test_callback_status_moves_only_as_the_table_allows(backends: Backends) -> None:
    task = await insert_task(backends.pool, callback_url="http://127.0.0.1:9/hook")
    for src in CallbackStatus:
        for dst in CallbackStatus:
            # any state as the starting point; the store has no way back to every one of them
            await backends.pool.execute(
                "UPDATE task SET callback_status = $2, callback_retry = 0 WHERE id = $1", task.id, src
            )
            moved = await outbox_store.move_status(backends.pool, [task.id], to=dst, retries=2)
            allowed = dst in CALLBACK_LEGAL[src]
            assert moved == ([task.id] if allowed else []), (src, dst)
            row = await backends.pool.fetchrow(
                "SELECT callback_status, callback_retry FROM task WHERE id = $1", task.id
            )
            assert (row["callback_status"], row["callback_retry"]) == ((dst, 2) if allowed else (src, 0)), (src, dst)
    silent = await insert_task(backends.pool)  # no callback URL: NONE for good
    assert await outbox_store.move_status(backends.pool, [silent.id], to=CallbackStatus.PENDING) == []


async def test_two_replicas_deliver_each_event_exactly_once(
    backends: Backends, settings: Settings, secret: str, notifier_factory: Any
) -> None:
    async with WebhookReceiver() as rx:
        tuned = fast(settings)
        replicas = [await notifier_factory(tuned), await notifier_factory(tuned, own=True)]
        tasks = [await insert_task(backends.pool, callback_url=rx.url()) for _ in range(12)]
        for t in tasks:  # claimed one by one: a claim takes its level's oldest QUEUED task
            await run_to(backends.pool, t.id, Status.PROCESSING)

        async def finish(task_id: int) -> None:
            await progress(backends.pool, task_id, 10, 60)
            await succeed(backends.pool, task_id)

        await asyncio.gather(*(finish(t.id) for t in tasks))
        await wait_for(lambda: len(rx.requests) >= len(tasks))
        await wait_for(
            lambda: _eq(backends.pool.fetchval("SELECT count(*) FROM callback_delivery WHERE status = 'DELIVERED'"), 12)
        )
        # stopped, a notifier has finished every send it began and begins none: what arrived is all that ever will
        for handle in replicas:
            await handle.stop()
    assert sorted(rx.ids()) == sorted(f"msg_{t.id}_6" for t in tasks)
    assert await backends.pool.fetchval("SELECT count(*) FROM callback_attempt") == len(tasks)
    events = await stream_events(backends)
    assert sorted((e.task_id, e.version) for e in events) == sorted((str(t.id), v) for t in tasks for v in range(1, 7))


# ---------------------------------------------------------------- relay


async def test_relay_killed_mid_batch_recovers_with_no_gap(
    backends: Backends, settings: Settings, notifier_factory: Any
) -> None:
    tuned = fast(settings, relay_batch_size=1000)
    published = asyncio.Event()

    async def crash_here(_ids: Sequence[int]) -> None:
        published.set()
        await asyncio.Event().wait()  # killed while the pass is open: published, not recorded

    first = await notifier_factory(tuned, own=True, signals=TestSignals(before_commit=crash_here))
    tasks = [await insert_task(backends.pool) for _ in range(5)]
    for t in tasks:
        await run_to(backends.pool, t.id, Status.PROCESSING, [])
    await asyncio.wait_for(published.wait(), 10)
    await asyncio.wait_for(first.kill(), 10)
    assert await backends.pool.fetchval("SELECT count(*) FROM event_outbox") >= 1
    on_stream_before = len(await stream_events(backends))
    assert on_stream_before >= 1  # the killed pass did publish

    await notifier_factory(tuned)
    for t in tasks:
        await run_to_more(backends, t.id)
    await all_relayed(backends.pool)
    events = await stream_events(backends)
    by_task: dict[str, list[int]] = {}
    for event in events:
        by_task.setdefault(event.task_id, []).append(event.version)
    for t in tasks:
        assert by_task[str(t.id)] == [1, 2, 3, 4], by_task[str(t.id)]  # each once, in version order, none missing


class _StalledJetStream:
    """publish_async waiting for room, as nats-py's does with too many in flight; like nats-py, it reports a
    cancellation during that wait as TooManyStalledMsgsError (until `honest`)."""

    def __init__(self) -> None:
        self.entered = asyncio.Event()
        self.honest = False

    async def publish_async(self, *_args: Any, **_kwargs: Any) -> Any:
        self.entered.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            if self.honest:
                raise
            raise nats.js.errors.TooManyStalledMsgsError from None


async def test_relay_stops_when_cancelled_inside_a_publish_that_hides_the_cancellation(
    backends: Backends, settings: Settings
) -> None:
    js = _StalledJetStream()
    relay = EventRelay(fast(settings), backends.pool, busmod.Bus(nc=backends.bus.nc, js=js))  # type: ignore[arg-type]
    await insert_task(backends.pool)  # its CREATED event waits to be relayed
    loop = asyncio.create_task(relay.run())
    try:
        await asyncio.wait_for(js.entered.wait(), 10)
        loop.cancel()
        done, _ = await asyncio.wait({loop}, timeout=5)
        assert loop in done and loop.cancelled()
    finally:
        js.honest = True  # lets a relay that ignored the cancel end, so a failure here does not hang the run
        loop.cancel()
        await asyncio.wait({loop}, timeout=5)
    assert await backends.pool.fetchval("SELECT count(*) FROM event_outbox") == 1


async def test_a_relay_pass_stalled_on_publishing_gives_up_after_its_timeout_and_records_nothing(
    backends: Backends, settings: Settings
) -> None:
    """No per-message stall wait any more: one timeout bounds the whole pass, and a pass it ends marks nothing."""
    js = _StalledJetStream()
    relay = EventRelay(
        fast(settings, relay_publish_timeout_seconds=0.3), backends.pool, busmod.Bus(nc=backends.bus.nc, js=js),  # type: ignore[arg-type]
    )
    await insert_task(backends.pool)
    began = time.monotonic()
    relayed = await asyncio.wait_for(relay.relay_once(), 10)
    assert relayed == 0 and js.entered.is_set()
    assert 0.3 <= time.monotonic() - began < 5  # the pass's own bound, not the test's
    assert await backends.pool.fetchval("SELECT count(*) FROM event_outbox") == 1
    assert asyncio.current_task().cancelling() == 0  # type: ignore[union-attr]  # the timeout's cancel was taken back




async def run_to_more(backends: Backends, task_id: int) -> None:
    await progress(backends.pool, task_id, 40)


async def test_relay_marks_events_published_and_records_lag(
    backends: Backends, settings: Settings, notifier_factory: Any
) -> None:
    handle = await notifier_factory(fast(settings))
    task = await insert_task(backends.pool)
    await run_to(backends.pool, task.id, Status.QUEUED)
    await all_relayed(backends.pool)
    assert await handle.relay.relay_once() == 0
    events = await stream_events(backends)
    assert [(e.version, Status.from_proto(e.to_status)) for e in events] == [(1, Status.CREATED), (2, Status.QUEUED)]
    assert events[1].from_status == task_pb2.TASK_STATUS_CREATED and events[1].event_id > events[0].event_id


# ---------------------------------------------------------------- streams (TaskEvents)






async def read_until(call: Any, done: Callable[[list[Any]], bool], within: float = 10.0) -> list[Any]:
    """Reads stream messages (keep-alives included) until `done(messages)` holds."""
    got: list[Any] = []
    async with asyncio.timeout(within):
        while not done(got):
            msg = await call.read()
            assert msg is not grpc.aio.EOF, "the stream ended early"
            got.append(msg)
    return got


def versions_of(messages: Sequence[Any]) -> list[int]:
    return [m.event.version for m in messages if m.WhichOneof("kind") == "event"]








async def test_watch_task_resume_after_a_dropped_connection_yields_every_version_once(
    backends: Backends, settings: Settings, api_key: str, notifier_factory: Any
) -> None:
    handle = await notifier_factory(fast(settings))
    pool = backends.pool
    task = await insert_task(pool)
    await run_to(pool, task.id, Status.QUEUED)
    async with events_stub(handle) as stub:
        call = stub.WatchTask(events_pb2.WatchTaskRequest(task_id=str(task.id)), metadata=bearer(api_key))
        first = await call.read()
        assert first.WhichOneof("kind") == "snapshot"
        assert (first.snapshot.version, first.snapshot.status) == (2, task_pb2.TASK_STATUS_QUEUED)
        assert first.snapshot.queue_position == 1
        await claimed(pool, task.id, worker_id="w1", lease_seconds=30.0)
        await progress(pool, task.id, 10)
        before = versions_of(await read_until(call, lambda got: 4 in versions_of(got)))
    # The connection is gone; the task moves on meanwhile.
    await progress(pool, task.id, 20, 30)

    async def more() -> None:  # keeps events coming while the resumed stream replays history and joins live
        await progress(pool, task.id, 40, 50, 60)
        await succeed(pool, task.id)

    async with events_stub(handle) as stub:
        producer = asyncio.create_task(more())
        call = stub.WatchTask(
            events_pb2.WatchTaskRequest(task_id=str(task.id), after_version=before[-1]), metadata=bearer(api_key)
        )
        after = []
        async with asyncio.timeout(10):
            async for msg in call:  # ends by itself at the terminal event
                assert msg.WhichOneof("kind") != "snapshot"
                after.append(msg)
        await producer
        assert await call.code() == grpc.StatusCode.OK
    assert before == [3, 4]
    assert versions_of(after) == [5, 6, 7, 8, 9, 10]
    last = after[-1].event
    assert last.to_status == task_pb2.TASK_STATUS_SUCCEEDED and last.result.sha256 == RESULT.sha256


async def test_watch_task_of_another_tenant_is_not_found(
    backends: Backends, settings: Settings, api_key: str, notifier_factory: Any
) -> None:
    handle = await notifier_factory(fast(settings))
    other_key, _ = await auth.create_key(backends.pool, settings.api_key_pepper, "tenant-b")
    task = await insert_task(backends.pool)
    cases = [
        (str(task.id), bearer(other_key), grpc.StatusCode.NOT_FOUND),
        ("123456789", bearer(api_key), grpc.StatusCode.NOT_FOUND),
        ("not-an-id", bearer(api_key), grpc.StatusCode.INVALID_ARGUMENT),
        (str(task.id), (), grpc.StatusCode.UNAUTHENTICATED),
    ]
    async with events_stub(handle) as stub:
        for task_id, metadata, code in cases:
            call = stub.WatchTask(events_pb2.WatchTaskRequest(task_id=task_id), metadata=metadata)
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await call.read()
            assert caught.value.code() == code, (task_id, caught.value.code())
    assert handle.hub.subscribers == 0


async def test_idle_streams_get_keepalives(
    backends: Backends, settings: Settings, api_key: str, notifier_factory: Any
) -> None:
    handle = await notifier_factory(fast(settings, stream_keepalive_seconds=0.2))
    task = await insert_task(backends.pool)
    async with events_stub(handle) as stub:
        call = stub.WatchTask(events_pb2.WatchTaskRequest(task_id=str(task.id)), metadata=bearer(api_key))
        assert (await call.read()).WhichOneof("kind") == "snapshot"
        started = time.monotonic()
        assert (await call.read()).WhichOneof("kind") == "keepalive"
        assert (await call.read()).WhichOneof("kind") == "keepalive"
        assert 0.3 <= time.monotonic() - started < 10.0  # two 0.2 s periods: never early, and no 15 s default
        call.cancel()
        every = stub.WatchTasks(events_pb2.WatchTasksRequest(), metadata=bearer(api_key))
        hello = await every.read()  # at once: caught up, with the resume point
        assert hello.WhichOneof("kind") == "keepalive" and int(hello.cursor) > 0
        again = await every.read()
        assert again.WhichOneof("kind") == "keepalive" and again.cursor == hello.cursor
        every.cancel()


async def test_slow_subscriber_is_told_where_to_resume_and_loses_nothing(
    backends: Backends, settings: Settings, api_key: str, notifier_factory: Any
) -> None:
    handle = await notifier_factory(fast(settings, stream_buffer_size=2))
    pool = backends.pool
    task = await insert_task(pool)
    await run_to(pool, task.id, Status.PROCESSING)
    # A client that does not read: tiny HTTP/2 windows make the server's writes block almost at once.
    tiny = [("grpc.http2.lookahead_bytes", 1024), ("grpc.http2.bdp_probe", 0)]
    async with events_stub(handle, tiny) as stub:
        call = stub.WatchTask(events_pb2.WatchTaskRequest(task_id=str(task.id)), metadata=bearer(api_key))
        assert (await call.read()).snapshot.version == 3
        for step in range(150):
            await progress(pool, task.id, step % 100)
        await succeed(pool, task.id)  # version 154
        await all_relayed(pool)
        got: list[Any] = []
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            async with asyncio.timeout(10):
                while (msg := await call.read()) is not grpc.aio.EOF:
                    got.append(msg)
    assert caught.value.code() == grpc.StatusCode.ABORTED
    info = error_info(caught.value)
    first_part = versions_of(got)
    last = first_part[-1] if first_part else 3  # on a loaded machine the overflow can come before any event is sent
    assert info.reason == "SUBSCRIBER_TOO_SLOW" and info.metadata["last_version"] == str(last)
    assert first_part == list(range(4, 4 + len(first_part))) and last < 154
    async with events_stub(handle) as stub:
        call = stub.WatchTask(
            events_pb2.WatchTaskRequest(task_id=str(task.id), after_version=last), metadata=bearer(api_key)
        )
        rest = [m async for m in call]
    assert first_part + versions_of(rest) == list(range(4, 155))


async def test_watch_tasks_follows_the_tenant_and_resumes_from_a_cursor(
    backends: Backends, settings: Settings, api_key: str, notifier_factory: Any
) -> None:
    handle = await notifier_factory(fast(settings))
    pool = backends.pool
    one, two = await insert_task(pool), await insert_task(pool)
    stranger = await insert_task(pool, user_id="tenant-b")
    await all_relayed(pool)
    async with events_stub(handle) as stub:
        call = stub.WatchTasks(events_pb2.WatchTasksRequest(), metadata=bearer(api_key))
        start_cursor = (await call.read()).cursor
        await run_to(pool, stranger.id, Status.SUCCEEDED)
        await run_to(pool, one.id, Status.PROCESSING)
        got = await read_until(
            call, lambda ms: any(m.event.version == 3 for m in ms if m.WhichOneof("kind") == "event")
        )
        cursor = got[-1].cursor
        call.cancel()
    # Disconnected: both tasks move on.
    await progress(pool, one.id, 50)
    await succeed(pool, one.id)
    await run_to(pool, two.id, Status.SUCCEEDED, [20])

    def seen(messages: Sequence[Any]) -> list[tuple[int, int]]:
        return [(int(m.event.task_id), m.event.version) for m in messages if m.WhichOneof("kind") == "event"]

    expected_rest = [(one.id, 4), (one.id, 5), (two.id, 2), (two.id, 3), (two.id, 4), (two.id, 5)]
    async with events_stub(handle) as stub:
        call = stub.WatchTasks(events_pb2.WatchTasksRequest(cursor=cursor), metadata=bearer(api_key))
        resumed = await read_until(call, lambda ms: set(expected_rest) <= set(seen(ms)))
        call.cancel()
        only_done = stub.WatchTasks(
            events_pb2.WatchTasksRequest(cursor=start_cursor, statuses=[task_pb2.TASK_STATUS_SUCCEEDED]),
            metadata=bearer(api_key),
        )
        finished = await read_until(only_done, lambda ms: len(seen(ms)) == 2)
        only_done.cancel()
    first = seen(got)
    assert first == [(one.id, 2), (one.id, 3)]  # version 1 came before the stream started; tenant-b is not here
    rest = seen(resumed)
    assert len(rest) == len(set(rest)) and stranger.id not in {t for t, _ in rest}
    assert sorted(set(first + rest)) == sorted([(one.id, v) for v in range(2, 6)] + [(two.id, v) for v in range(2, 6)])
    assert sorted(seen(finished)) == sorted([(one.id, 5), (two.id, 5)])
    assert all(int(m.cursor) >= int(start_cursor) for m in resumed)
