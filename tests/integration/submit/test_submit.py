"""The TaskGateway over real gRPC, PostgreSQL and NATS: submit, idempotency, dispatch, reads, cancel, results."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
import shutil
import signal
import sys
import time
from collections.abc import AsyncIterator, Awaitable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.protobuf.timestamp_pb2 import Timestamp
from google.rpc import error_details_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_status import rpc_status

from services.submit.cache import TerminalCache
from services.submit.service import SubmitHandle, poll_interval, start
from taskgate import bus as busmod
from taskgate import store
from taskgate.config import Settings
from taskgate.model import TaskRow
from taskgate.results import ObjectStoreResults
from taskgate.runtime import Backends
from taskgate.states import Priority, Status
from taskgate.store import get_task
from taskgate_api.v1 import gateway_pb2, gateway_pb2_grpc, task_pb2
from taskgate_local.embedded import EmbeddedNats, free_port
from tests.support.factories import Claim, Metadata, Step, insert_task, key_for, moved
from tests.support.harness import ROOT, details_of, wait_for


async def failure(call: Awaitable[object]) -> tuple[grpc.StatusCode, str, list[Any]]:
    """The status code, message and google.rpc details of a call that must fail."""
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call
    status = rpc_status.from_call(info.value)
    return info.value.code(), info.value.details() or "", details_of(status) if status else []


def reason_of(details: list[Any]) -> str:
    return next(d.reason for d in details if isinstance(d, error_details_pb2.ErrorInfo))


def req(prompt: str = "a red fox in the snow", **fields: Any) -> gateway_pb2.SubmitTaskRequest:
    return gateway_pb2.SubmitTaskRequest(prompt=prompt, **fields)


async def submit(
    stub: Any, md: Metadata, request: gateway_pb2.SubmitTaskRequest | None = None
) -> gateway_pb2.SubmitTaskResponse:
    resp: gateway_pb2.SubmitTaskResponse = await stub.SubmitTask(request or req(), metadata=md, timeout=10)
    return resp


async def dispatched(backends: Backends, task_id: int | str, status: Status = Status.QUEUED) -> TaskRow:
    """The task once its dispatcher pass (after the submit's answer) has moved it to `status`."""
    async def moved() -> bool:
        row = await get_task(backends.pool, int(task_id))
        return row is not None and row.status is status

    await wait_for(moved)
    row = await get_task(backends.pool, int(task_id))
    assert row is not None
    return row


async def drive(backends: Backends, task_id: int, *changes: Step) -> TaskRow:
    row: TaskRow | None = None
    for change in changes:
        out = await moved(backends.pool, task_id, change)
        assert out.applied, (change, out.rejection)
        row = out.task
    assert row is not None
    return row


CLAIM = Claim("w1", 10.0)


# Submit, dispatch, defaults


async def test_submit_stores_canonical_task_publishes_once_and_queues(
    stub: Any, backends: Backends, settings: Settings
) -> None:
    md = await key_for(backends)
    resp = await submit(stub, md)
    task = resp.task  # the answer follows the admission commit: CREATED, dispatched after it
    assert resp.created and task.status == task_pb2.TASK_STATUS_CREATED and task.queue_position == 0
    assert (task.model_id, task.task_type, task.priority) == ("wan-tiny", "text-to-video", task_pb2.PRIORITY_NORMAL)
    spec = settings.models["wan-tiny"]
    p = task.params
    assert (p.num_frames, p.width, p.height, p.num_inference_steps, p.fps) == (
        spec.default_frames, spec.default_width, spec.default_height, spec.default_steps, spec.default_fps)
    assert p.guidance_scale == pytest.approx(spec.default_guidance) and p.HasField("seed")

    row = await dispatched(backends, task.id)
    assert row.user_id == "tenant-a"
    assert row.request_payload["seed"] == p.seed and row.idempotency_derived and row.max_retries == settings.max_retries
    history = await backends.pool.fetch(
        "SELECT from_status::text, to_status::text, actor FROM task_event WHERE task_id = $1 ORDER BY version", row.id)
    assert [tuple(h) for h in history] == [(None, "CREATED", "submit"), ("CREATED", "QUEUED", "submit")]

    subject = busmod.task_subject("wan-tiny", 5)
    msg = await backends.bus.js.get_last_msg(busmod.TASKS_STREAM, subject)
    assert msg.headers is not None and msg.headers["Nats-Msg-Id"] == f"{task.id}.q0"
    dispatch = task_pb2.TaskDispatch.FromString(msg.data or b"")
    assert (dispatch.task_id, dispatch.model_id, dispatch.priority) == (task.id, "wan-tiny", task_pb2.PRIORITY_NORMAL)
    assert (await backends.bus.js.stream_info(busmod.TASKS_STREAM)).state.messages == 1


async def test_given_seed_params_and_options_are_kept(stub: Any, backends: Backends) -> None:
    md = await key_for(backends, max_priority=Priority.HIGH)  # HIGH is an entitlement
    params = task_pb2.VideoParams(num_frames=17, width=64, height=48, num_inference_steps=3, guidance_scale=5.1,
                                  fps=12, seed=42, negative_prompt="blurry")
    resp = await submit(stub, md, req("a cat", model_id="sleepy", params=params, priority=task_pb2.PRIORITY_HIGH,
                                      metadata={"job": "7"}, max_retries=0, callback_url="http://127.0.0.1:9/hook",
                                      callback_events=["PROGRESS"]))
    t = resp.task
    assert (t.params.num_frames, t.params.width, t.params.height, t.params.seed) == (17, 64, 48, 42)
    assert t.params.guidance_scale == pytest.approx(5.1) and t.params.negative_prompt == "blurry"
    assert (t.priority, t.max_retries, dict(t.metadata)) == (task_pb2.PRIORITY_HIGH, 0, {"job": "7"})
    assert t.callback_status == task_pb2.CALLBACK_STATUS_PENDING and list(t.callback_events) == ["PROGRESS"]
    row = await get_task(backends.pool, int(t.id))
    assert row is not None and row.request_payload["guidance_scale"] == 5.1
    assert row.queue_name == busmod.task_subject("sleepy", 10)


async def test_unseeded_requests_get_different_stored_seeds(stub: Any, backends: Backends) -> None:
    md = await key_for(backends)
    a = await submit(stub, md, req(idempotency_key="one"))
    b = await submit(stub, md, req(idempotency_key="two"))
    assert a.task.id != b.task.id and a.task.params.seed != b.task.params.seed


async def test_missing_or_unknown_key_is_unauthenticated(stub: Any) -> None:
    code, _, details = await failure(stub.SubmitTask(req(), timeout=5))
    assert code == grpc.StatusCode.UNAUTHENTICATED and reason_of(details) == "UNAUTHENTICATED"
    code, _, _ = await failure(stub.GetTask(gateway_pb2.GetTaskRequest(task_id="1"),
                                            metadata=(("authorization", "Bearer tg_nope"),), timeout=5))
    assert code == grpc.StatusCode.UNAUTHENTICATED


# Idempotency


async def test_repeated_request_returns_the_existing_task(stub: Any, backends: Backends) -> None:
    md = await key_for(backends)
    first = await submit(stub, md, req(idempotency_key="order-1"))
    again = await submit(stub, md, req(idempotency_key="order-1"))
    assert first.created and not again.created and again.task.id == first.task.id
    derived = await submit(stub, md, req("a derived key"))
    derived_again = await submit(stub, md, req("a derived key"))
    assert derived.created and not derived_again.created and derived_again.task.id == derived.task.id
    assert await backends.pool.fetchval("SELECT count(*) FROM task") == 2
    assert (await backends.bus.js.stream_info(busmod.TASKS_STREAM)).state.messages == 2


async def test_concurrent_identical_submits_make_one_task_and_one_message(stub: Any, backends: Backends) -> None:
    md = await key_for(backends)
    results = await asyncio.gather(*(submit(stub, md, req("same request")) for _ in range(20)))
    assert len({r.task.id for r in results}) == 1
    assert sum(r.created for r in results) == 1
    assert await backends.pool.fetchval("SELECT count(*) FROM task") == 1
    assert (await backends.bus.js.stream_info(busmod.TASKS_STREAM)).state.messages == 1


async def test_same_key_for_a_different_request_is_already_exists(stub: Any, backends: Backends) -> None:
    md = await key_for(backends, max_priority=Priority.HIGH)  # HIGH is an entitlement
    first = await submit(stub, md, req("one thing", idempotency_key="k1"))
    code, _, details = await failure(
        stub.SubmitTask(req("another thing", idempotency_key="k1"), metadata=md, timeout=5)
    )
    assert code == grpc.StatusCode.ALREADY_EXISTS
    info = next(d for d in details if isinstance(d, error_details_pb2.ErrorInfo))
    assert info.reason == "IDEMPOTENCY_KEY_REUSED" and info.metadata["task_id"] == first.task.id
    code, _, _ = await failure(stub.SubmitTask(req("one thing", idempotency_key="k1", priority=task_pb2.PRIORITY_HIGH),
                                               metadata=md, timeout=5))
    assert code == grpc.StatusCode.ALREADY_EXISTS
    assert await backends.pool.fetchval("SELECT count(*) FROM task") == 1


async def test_idempotency_keys_are_scoped_per_tenant(stub: Any, backends: Backends) -> None:
    a = await submit(stub, await key_for(backends, "tenant-a"), req(idempotency_key="shared"))
    b = await submit(stub, await key_for(backends, "tenant-b"), req(idempotency_key="shared"))
    assert a.created and b.created and a.task.id != b.task.id and b.task.user_id == "tenant-b"


async def test_cancelled_derived_request_can_be_submitted_again(stub: Any, backends: Backends) -> None:
    md = await key_for(backends)
    first = await submit(stub, md)
    await stub.CancelTask(gateway_pb2.CancelTaskRequest(task_id=first.task.id), metadata=md, timeout=5)
    second = await submit(stub, md)
    assert second.created and second.task.id != first.task.id


# Dispatch failures and races


async def test_nats_down_leaves_task_created_and_returned(
    settings: Settings, backends: Backends, tmp_path: Path
) -> None:
    private = EmbeddedNats(tmp_path / "n").start()
    bus = await busmod.connect(private.url, "submit-test")
    try:
        await busmod.declare(bus, settings)
        quick = settings.model_copy(update={"submit_publish_timeout_seconds": 0.3})
        handle = await start(quick, Backends(quick, backends.pool, bus, backends.database_url, private.url))
        private.stop()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{handle.port}") as channel:
                stub = gateway_pb2_grpc.TaskGatewayStub(channel)
                began = time.monotonic()
                resp = await submit(stub, await key_for(backends))
                assert time.monotonic() - began < 3
        finally:
            await handle.stop(0)
    finally:
        private.stop()
        with contextlib.suppress(ConnectionError):  # the server is gone; closing may find the socket reset
            await asyncio.wait_for(bus.nc.close(), 5)
    assert resp.created and resp.task.status == task_pb2.TASK_STATUS_CREATED
    row = await get_task(backends.pool, int(resp.task.id))
    assert row is not None and row.status is Status.CREATED and row.version == 1


class _ClaimAfterPublish:
    """JetStream whose publish lets a 'worker' claim the task before the submit's QUEUE move commits."""

    def __init__(self, js: Any, backends: Backends) -> None:
        self._js = js
        self._backends = backends

    async def publish_async(self, subject: str, payload: bytes, **kwargs: Any) -> Any:
        ack = await (await self._js.publish_async(subject, payload, **kwargs))
        task_id = int(task_pb2.TaskDispatch.FromString(payload).task_id)
        await drive(self._backends, task_id, CLAIM)
        acked: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        acked.set_result(ack)
        return acked


async def test_message_outrunning_the_commit_returns_true_status(settings: Settings, backends: Backends) -> None:
    racing = busmod.Bus(nc=backends.bus.nc, js=_ClaimAfterPublish(backends.bus.js, backends))  # type: ignore[arg-type]
    handle = await start(settings, Backends(settings, backends.pool, racing, backends.database_url, backends.nats_url))
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{handle.port}") as channel:
            resp = await submit(gateway_pb2_grpc.TaskGatewayStub(channel), await key_for(backends))
        assert resp.created and resp.task.status == task_pb2.TASK_STATUS_CREATED
        # the worker claimed it from CREATED before the pass's QUEUED move, which then leaves the claim alone
        row = await dispatched(backends, resp.task.id, Status.PROCESSING)
    finally:
        await handle.stop(5)  # the pass's QUEUED move runs before the dispatcher closes
    history = await backends.pool.fetch(
        "SELECT to_status::text FROM task_event WHERE task_id = $1 ORDER BY version", row.id
    )
    assert row.worker_id == "w1" and [h[0] for h in history] == ["CREATED", "PROCESSING"]


async def test_unresponsive_database_gives_deadline_exceeded_within_the_deadline(stub: Any, backends: Backends) -> None:
    md = await key_for(backends)
    async with backends.pool.acquire() as conn, conn.transaction():
        await conn.execute("SELECT 1 FROM tenant WHERE id = 'tenant-a' FOR UPDATE")  # submit waits on this lock
        began = time.monotonic()
        code, message, _ = await failure(stub.SubmitTask(req(idempotency_key="k"), metadata=md, timeout=2.0))
        elapsed = time.monotonic() - began
    assert code == grpc.StatusCode.DEADLINE_EXCEEDED and elapsed < 2.0
    # it says only what is known: the statement was running, so it may have committed
    assert "it may have been admitted; retry with the same idempotency key" in message, message
    # the caller left, its statement did not: once the lock is gone the retry with the same key finds one task
    again = await submit(stub, md, req(idempotency_key="k"))
    assert not again.created
    assert await backends.pool.fetchval("SELECT count(*) FROM task") == 1
    assert again.task.id == str(await backends.pool.fetchval("SELECT id FROM task"))


async def test_a_database_timeout_gives_unavailable_with_retry_info(settings: Settings, backends: Backends) -> None:
    handle = await start(settings.model_copy(update={"submit_db_timeout_seconds": 0.3}), backends)
    md = await key_for(backends)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{handle.port}") as channel:
            stub = gateway_pb2_grpc.TaskGatewayStub(channel)
            async with backends.pool.acquire() as conn, conn.transaction():
                await conn.execute("SELECT 1 FROM tenant WHERE id = 'tenant-a' FOR UPDATE")
                code, _, details = await failure(stub.SubmitTask(req(), metadata=md, timeout=5.0))
    finally:
        await handle.stop(0)
    assert code == grpc.StatusCode.UNAVAILABLE
    assert any(isinstance(d, error_details_pb2.RetryInfo) for d in details)
    assert await backends.pool.fetchval("SELECT count(*) FROM task") == 0


# GetTask


async def test_get_task_reports_queue_position_by_priority_then_age(stub: Any, backends: Backends) -> None:
    md = await key_for(backends, max_pending=10, max_priority=Priority.HIGH)
    low = await submit(stub, md, req("l", priority=task_pb2.PRIORITY_LOW))
    first = await submit(stub, md, req("n1"))
    second = await submit(stub, md, req("n2"))
    high = await submit(stub, md, req("h", priority=task_pb2.PRIORITY_HIGH))
    other_model = await submit(stub, md, req("s", model_id="sleepy"))
    for t in (low, first, second, high, other_model):
        await dispatched(backends, t.task.id)

    async def position(task_id: str) -> int:
        resp = await stub.GetTask(gateway_pb2.GetTaskRequest(task_id=task_id), metadata=md, timeout=5)
        return int(resp.task.queue_position)

    assert [await position(t.task.id) for t in (high, first, second, low, other_model)] == [1, 2, 3, 4, 1]
    await drive(backends, int(high.task.id), CLAIM)
    assert [await position(t.task.id) for t in (high, first, second, low)] == [0, 1, 2, 3]


async def test_get_task_suggests_poll_interval_by_age(stub: Any, backends: Backends) -> None:
    md = await key_for(backends)
    task_id = (await submit(stub, md)).task.id

    async def interval() -> float:
        resp = await stub.GetTask(gateway_pb2.GetTaskRequest(task_id=task_id), metadata=md, timeout=5)
        return float(resp.suggested_poll_interval.ToTimedelta().total_seconds())

    assert await interval() == 2.0
    for age, expected in ((60, 5.0), (600, 10.0)):
        await backends.pool.execute(
            "UPDATE task SET created_at = now() - make_interval(secs => $2) WHERE id = $1", int(task_id), float(age))
        assert await interval() == expected


def test_poll_interval_boundaries() -> None:
    t0 = datetime(2026, 1, 1, tzinfo=UTC)
    assert [poll_interval(t0, t0 + timedelta(seconds=s)) for s in (0, 29.9, 30, 119, 120, 3600)] == [2, 2, 5, 5, 10, 10]


async def test_terminal_tasks_are_served_from_the_cache(stub: Any, backends: Backends, gateway: SubmitHandle) -> None:
    md = await key_for(backends)
    task_id = (await submit(stub, md)).task.id
    await stub.CancelTask(gateway_pb2.CancelTaskRequest(task_id=task_id), metadata=md, timeout=5)
    # a change the database makes behind the cache's back (no new version) must not be seen
    await backends.pool.execute("UPDATE task SET error_msg = 'changed' WHERE id = $1", int(task_id))
    resp = await stub.GetTask(gateway_pb2.GetTaskRequest(task_id=task_id), metadata=md, timeout=5)
    assert resp.task.status == task_pb2.TASK_STATUS_CANCELED and resp.task.error_message == ""

    live = (await submit(stub, md, req("still running"))).task.id
    await backends.pool.execute("UPDATE task SET error_msg = 'seen' WHERE id = $1", int(live))
    resp = await stub.GetTask(gateway_pb2.GetTaskRequest(task_id=live), metadata=md, timeout=5)
    assert resp.task.error_message == "seen"


async def test_terminal_cache_is_bounded_and_skips_pending_webhooks(backends: Backends) -> None:
    cache = TerminalCache(2)
    rows = []
    for i in range(3):
        task = await insert_task(backends.pool, prompt=f"p{i}")
        rows.append(await drive(backends, task.id, store.Cancel(store.CancelMode.SOFT)))
        cache.put(rows[-1])
    assert len(cache) == 2 and cache.get(rows[0].id) is None and cache.get(rows[2].id) is not None
    hooked = await insert_task(backends.pool, prompt="hook", callback_url="http://127.0.0.1:9/h")
    cache.put(await drive(backends, hooked.id, store.Cancel(store.CancelMode.SOFT)))
    assert cache.get(hooked.id) is None
    queued = await drive(backends, (await insert_task(backends.pool, prompt="q")).id, store.Queue())
    cache.put(queued)
    assert cache.get(queued.id) is None


async def test_malformed_task_id_is_invalid_argument(stub: Any, backends: Backends) -> None:
    md = await key_for(backends)
    for bad in ("", "abc", "-1", "99999999999999999999"):
        code, _, details = await failure(stub.GetTask(gateway_pb2.GetTaskRequest(task_id=bad), metadata=md, timeout=5))
        assert code == grpc.StatusCode.INVALID_ARGUMENT
        assert details[0].field_violations[0].field == "task_id"


# ListTasks


async def _list_all(stub: Any, md: Metadata, **filters: Any) -> list[str]:
    ids: list[str] = []
    token = ""
    while True:
        resp = await stub.ListTasks(gateway_pb2.ListTasksRequest(page_token=token, **filters), metadata=md, timeout=5)
        ids += [t.id for t in resp.tasks]
        token = resp.next_page_token
        if not token:
            return ids


async def test_list_tasks_pages_newest_first_stable_under_inserts(stub: Any, backends: Backends) -> None:
    md = await key_for(backends)
    made = [(await insert_task(backends.pool, prompt=f"t{i}")).id for i in range(7)]
    await insert_task(backends.pool, user_id="tenant-b", prompt="not yours")
    newest_first = [str(i) for i in reversed(made)]

    page = await stub.ListTasks(gateway_pb2.ListTasksRequest(page_size=3), metadata=md, timeout=5)
    seen = [t.id for t in page.tasks]
    assert seen == newest_first[:3] and page.next_page_token
    for i in range(2):
        await insert_task(backends.pool, prompt=f"late{i}")
    token = page.next_page_token
    while token:
        page = await stub.ListTasks(gateway_pb2.ListTasksRequest(page_size=3, page_token=token), metadata=md, timeout=5)
        seen += [t.id for t in page.tasks]
        token = page.next_page_token
    assert seen == newest_first
    assert len(await _list_all(stub, md)) == 9


async def test_list_tasks_filters_by_status_and_time(stub: Any, backends: Backends) -> None:
    md = await key_for(backends)
    early = await insert_task(backends.pool, prompt="early")
    queued = await drive(backends, (await insert_task(backends.pool, prompt="q")).id, store.Queue())
    canceled = await drive(
        backends, (await insert_task(backends.pool, prompt="c")).id, store.Cancel(store.CancelMode.HARD)
    )
    by_status = await _list_all(stub, md, statuses=[task_pb2.TASK_STATUS_QUEUED, task_pb2.TASK_STATUS_CANCELED])
    assert by_status == [str(canceled.id), str(queued.id)]

    after, before = Timestamp(), Timestamp()
    after.FromDatetime(early.created_at)
    before.FromDatetime(canceled.created_at)
    assert await _list_all(stub, md, created_after=after, created_before=before) == [str(queued.id)]


async def test_list_tasks_rejects_bad_tokens_and_sizes(stub: Any, backends: Backends) -> None:
    md = await key_for(backends)
    for i in range(3):
        await insert_task(backends.pool, prompt=f"t{i}")
    page = await stub.ListTasks(gateway_pb2.ListTasksRequest(page_size=1), metadata=md, timeout=5)
    assert len(page.tasks) == 1
    other_filter = gateway_pb2.ListTasksRequest(
        page_token=page.next_page_token, statuses=[task_pb2.TASK_STATUS_CREATED]
    )
    for bad in (
        gateway_pb2.ListTasksRequest(page_token="garbage!"),
        other_filter,
        gateway_pb2.ListTasksRequest(page_size=-1),
        gateway_pb2.ListTasksRequest(statuses=[task_pb2.TASK_STATUS_UNSPECIFIED]),
    ):
        code, _, _ = await failure(stub.ListTasks(bad, metadata=md, timeout=5))
        assert code == grpc.StatusCode.INVALID_ARGUMENT
    big = await stub.ListTasks(gateway_pb2.ListTasksRequest(page_size=100_000), metadata=md, timeout=5)
    assert len(big.tasks) == 3 and not big.next_page_token


# CancelTask


async def test_cancel_created_and_queued_tasks_at_once(stub: Any, backends: Backends) -> None:
    md = await key_for(backends)
    created = await insert_task(backends.pool)
    resp = await stub.CancelTask(gateway_pb2.CancelTaskRequest(task_id=str(created.id)), metadata=md, timeout=5)
    assert resp.task.status == task_pb2.TASK_STATUS_CANCELED
    queued = (await submit(stub, md, req("queued one"))).task
    resp = await stub.CancelTask(gateway_pb2.CancelTaskRequest(task_id=queued.id, hard=True), metadata=md, timeout=5)
    assert resp.task.status == task_pb2.TASK_STATUS_CANCELED
    modes = await backends.pool.fetch("SELECT id, cancel_mode, status::text FROM task ORDER BY id")
    assert [(r["cancel_mode"], r["status"]) for r in modes] == [("soft", "CANCELED"), ("hard", "CANCELED")]


@pytest.mark.parametrize("hard", [False, True])
async def test_cancel_processing_task_signals_the_worker(stub: Any, backends: Backends, hard: bool) -> None:
    md = await key_for(backends)
    task = await insert_task(backends.pool)
    await drive(backends, task.id, store.Queue(), CLAIM)
    received: asyncio.Queue[task_pb2.CancelSignal] = asyncio.Queue()

    async def on_signal(msg: Any) -> None:
        await received.put(task_pb2.CancelSignal.FromString(msg.data))

    sub = await backends.bus.nc.subscribe(busmod.CANCEL_SUBJECT, cb=on_signal)
    await backends.bus.nc.flush()
    try:
        resp = await stub.CancelTask(
            gateway_pb2.CancelTaskRequest(task_id=str(task.id), hard=hard), metadata=md, timeout=5
        )
        signal = await asyncio.wait_for(received.get(), 5)
    finally:
        await sub.unsubscribe()
    assert resp.task.status == task_pb2.TASK_STATUS_CANCELED
    assert (signal.task_id, signal.hard) == (str(task.id), hard)
    row = await get_task(backends.pool, task.id)
    assert row is not None and row.cancel_mode == ("hard" if hard else "soft")


async def test_cancel_twice_returns_the_canceled_task_and_terminal_is_refused(stub: Any, backends: Backends) -> None:
    md = await key_for(backends)
    task_id = (await submit(stub, md)).task.id
    first = await stub.CancelTask(gateway_pb2.CancelTaskRequest(task_id=task_id), metadata=md, timeout=5)
    again = await stub.CancelTask(gateway_pb2.CancelTaskRequest(task_id=task_id, hard=True), metadata=md, timeout=5)
    assert again.task == first.task

    done = await insert_task(backends.pool, prompt="done")
    await drive(backends, done.id, store.Queue(), CLAIM, store.Fail(store.TaskError("E", "boom")))
    code, _, details = await failure(
        stub.CancelTask(gateway_pb2.CancelTaskRequest(task_id=str(done.id)), metadata=md, timeout=5))
    assert code == grpc.StatusCode.FAILED_PRECONDITION and reason_of(details) == "TASK_FINISHED"


async def test_cancel_racing_a_finish_tells_the_truth(stub: Any, backends: Backends, gateway: SubmitHandle) -> None:
    md = await key_for(backends)
    task = await insert_task(backends.pool)
    await drive(backends, task.id, store.Queue(), CLAIM)
    # the service read PROCESSING; the worker finishes before the guarded cancel runs
    async with backends.pool.acquire() as conn, conn.transaction():
        await conn.execute("SELECT 1 FROM task WHERE id = $1 FOR UPDATE", task.id)
        call = stub.CancelTask(gateway_pb2.CancelTaskRequest(task_id=str(task.id)), metadata=md, timeout=5)
        pending = asyncio.ensure_future(failure(call))
        await _wait_for_lock_waiter(backends, task.id)
        await store.apply(
            conn, task.id, store.Succeed(store.ResultRef("mem://x", "video/mp4", 1, "ab" * 32)), actor="test"
        )
    code, _, details = await pending
    assert code == grpc.StatusCode.FAILED_PRECONDITION and reason_of(details) == "TASK_FINISHED"


async def _wait_for_lock_waiter(backends: Backends, task_id: int, within: float = 5.0) -> None:
    """Until another session waits for a row lock (the service's guarded UPDATE)."""

    async def waiting() -> bool:
        return bool(await backends.pool.fetchval(
            "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND datname = current_database()"))

    await wait_for(waiting, within, every=0.02)


# GetTaskResult


async def test_get_task_result_streams_the_stored_bytes(stub: Any, backends: Backends) -> None:
    md = await key_for(backends)
    data = bytes(range(256)) * 3000  # 768,000 bytes: several chunks
    stored = await ObjectStoreResults(backends.bus).put("r-a1.mp4", data, "video/mp4")
    task = await insert_task(backends.pool)
    await drive(backends, task.id, store.Queue(), CLAIM,
                store.Succeed(store.ResultRef(stored.uri, stored.content_type, stored.size, stored.sha256)))
    chunks = [c async for c in stub.GetTaskResult(gateway_pb2.GetTaskResultRequest(task_id=str(task.id)),
                                                  metadata=md, timeout=10)]
    assert len(chunks) > 1 and b"".join(c.data for c in chunks) == data
    assert chunks[0].info.sha256 == hashlib.sha256(data).hexdigest() and chunks[0].info.size_bytes == len(data)
    assert chunks[0].info.content_type == "video/mp4" and not chunks[1].HasField("info")
    assert [c.offset for c in chunks] == [sum(len(x.data) for x in chunks[:i]) for i in range(len(chunks))]


async def test_result_of_unfinished_task_is_failed_precondition(stub: Any, backends: Backends) -> None:
    md = await key_for(backends)
    task_id = (await submit(stub, md)).task.id
    code, _, details = await failure(_drain(stub.GetTaskResult(gateway_pb2.GetTaskResultRequest(task_id=task_id),
                                                                metadata=md, timeout=5)))
    assert code == grpc.StatusCode.FAILED_PRECONDITION and reason_of(details) == "TASK_NOT_SUCCEEDED"


async def _drain(stream: Any) -> list[Any]:
    return [c async for c in stream]


# Tenant isolation


async def test_other_tenants_tasks_look_like_missing_ones(stub: Any, backends: Backends) -> None:
    owner = await key_for(backends, "tenant-a")
    stranger = await key_for(backends, "tenant-b")
    data = b"video"
    stored = await ObjectStoreResults(backends.bus).put("iso.mp4", data, "video/mp4")
    task = await insert_task(backends.pool)
    await drive(backends, task.id, store.Queue(), CLAIM,
                store.Succeed(store.ResultRef(stored.uri, stored.content_type, stored.size, stored.sha256)))
    missing = str(task.id + 1)

    async def outcomes(task_id: str) -> list[tuple[grpc.StatusCode, str, list[Any]]]:
        return [
            await failure(stub.GetTask(gateway_pb2.GetTaskRequest(task_id=task_id), metadata=stranger, timeout=5)),
            await failure(
                stub.CancelTask(gateway_pb2.CancelTaskRequest(task_id=task_id), metadata=stranger, timeout=5)
            ),
            await failure(
                _drain(
                    stub.GetTaskResult(gateway_pb2.GetTaskResultRequest(task_id=task_id), metadata=stranger, timeout=5)
                )
            ),
        ]

    theirs, nobodys = await outcomes(str(task.id)), await outcomes(missing)
    assert theirs == nobodys and all(code == grpc.StatusCode.NOT_FOUND for code, _, _ in theirs)
    listed = await stub.ListTasks(gateway_pb2.ListTasksRequest(), metadata=stranger, timeout=5)
    assert list(listed.tasks) == []
    row = await get_task(backends.pool, task.id)
    assert row is not None and row.status is Status.SUCCEEDED
    own = await stub.GetTask(gateway_pb2.GetTaskRequest(task_id=str(task.id)), metadata=owner, timeout=5)
    assert own.task.status == task_pb2.TASK_STATUS_SUCCEEDED


# The process and its transport


async def test_service_process_serves_logs_safely_and_stops_on_sigterm(settings: Settings, backends: Backends,
                                                                       tmp_path: Path) -> None:
    port = free_port()
    env = {
        **os.environ,
        "TASKGATE_DATABASE_URL": settings.database_url or "",
        "TASKGATE_NATS_URL": settings.nats_url or "",
        "TASKGATE_SUBMIT_PORT": str(port),
        "TASKGATE_SUBMIT_METRICS_PORT": "0",
        "TASKGATE_STATE_DIR": str(tmp_path),
    }
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "services.submit", env=env, cwd=ROOT,
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE,
    )
    secret_prompt = "a prompt that must never reach the logs"
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            health = health_pb2_grpc.HealthStub(channel)
            check = await health.Check(health_pb2.HealthCheckRequest(service=""), wait_for_ready=True, timeout=30)
            assert check.status == health_pb2.HealthCheckResponse.SERVING
            stub = gateway_pb2_grpc.TaskGatewayStub(channel)
            resp = await submit(stub, await key_for(backends), req(secret_prompt))
            assert resp.task.status == task_pb2.TASK_STATUS_CREATED
            await dispatched(backends, resp.task.id)
        proc.send_signal(signal.SIGTERM)
        _, stderr = await asyncio.wait_for(proc.communicate(), 30)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    assert proc.returncode == 0
    lines = [json.loads(line) for line in stderr.decode().splitlines() if line.startswith("{")]
    created = next(line for line in lines if line["msg"] == "task created")
    assert created["task_id"] == resp.task.id and created["prompt_chars"] == len(secret_prompt)
    assert any(line["msg"] == "transition" and line["to"] == "QUEUED" for line in lines)
    assert secret_prompt not in stderr.decode()


async def test_tls_port(settings: Settings, backends: Backends, tmp_path: Path) -> None:
    if shutil.which("openssl") is None:
        pytest.skip("openssl is needed to make a test certificate")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    made = await asyncio.create_subprocess_exec(
        "openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-days", "1",
        "-subj", "/CN=localhost", "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1",
        "-keyout", str(key), "-out", str(cert), stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL,
    )
    assert await made.wait() == 0
    secure = settings.model_copy(update={"tls_cert_file": cert, "tls_key_file": key})
    handle = await start(secure, backends)
    try:
        credentials = grpc.ssl_channel_credentials(root_certificates=cert.read_bytes())
        async with grpc.aio.secure_channel(f"localhost:{handle.port}", credentials) as channel:
            resp = await submit(gateway_pb2_grpc.TaskGatewayStub(channel), await key_for(backends))
            assert resp.created
        async with grpc.aio.insecure_channel(f"127.0.0.1:{handle.port}") as plain:
            code, _, _ = await failure(gateway_pb2_grpc.TaskGatewayStub(plain).GetTask(
                gateway_pb2.GetTaskRequest(task_id=resp.task.id), timeout=2))
            assert code == grpc.StatusCode.UNAVAILABLE
    finally:
        await handle.stop(0)


async def test_regenerate_never_reuses_the_source_output(stub: Any, backends: Backends) -> None:
    """A regenerate is never the source's request (it always names a seed), so a soft-cancelled run's kept output
    (kept for an identical request) is never what it returns."""
    md = await key_for(backends)
    first = await submit(stub, md, req("the same prompt, no seed"))
    await stub.CancelTask(gateway_pb2.CancelTaskRequest(task_id=first.task.id), metadata=md, timeout=10)
    again = await stub.RegenerateTask(gateway_pb2.RegenerateTaskRequest(task_id=first.task.id), metadata=md, timeout=10)
    source, regenerated = (
        await get_task(backends.pool, int(first.task.id)),
        await get_task(backends.pool, int(again.task.id)),
    )
    assert source is not None and regenerated is not None
    assert regenerated.request_hash != source.request_hash
    assert regenerated.request_payload["seed"] == again.task.params.seed != first.task.params.seed


async def test_an_accepted_request_retried_after_its_priority_was_withdrawn_gets_its_task(
    settings: Settings, backends: Backends
) -> None:
    """The idempotent lookup comes before the priority rule: the tenant lost HIGH after its request was accepted."""
    md = await key_for(backends, "tenant-high", max_priority=Priority.HIGH)
    request = req("urgent", priority=task_pb2.PRIORITY_HIGH, idempotency_key="order-7")
    async with fresh_gateway(settings, backends) as stub:
        first = await submit(stub, md, request)
    assert first.created
    await backends.pool.execute("UPDATE tenant SET max_priority = 5 WHERE id = 'tenant-high'")
    async with fresh_gateway(settings, backends) as stub:  # a fresh gateway: no cached entitlement
        retried = await submit(stub, md, request)
        assert (retried.created, retried.task.id) == (False, first.task.id)
        code, _, details = await failure(
            stub.SubmitTask(req("new and urgent", priority=task_pb2.PRIORITY_HIGH), metadata=md, timeout=10)
        )
    assert code == grpc.StatusCode.PERMISSION_DENIED and reason_of(details) == "PRIORITY_NOT_ALLOWED"


@contextlib.asynccontextmanager
async def fresh_gateway(settings: Settings, backends: Backends) -> AsyncIterator[Any]:
    """A TaskGateway stub on a gateway of its own (an empty key cache)."""
    handle = await start(settings, backends)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{handle.port}") as channel:
            yield gateway_pb2_grpc.TaskGatewayStub(channel)
    finally:
        await handle.stop(0)
