"""SubmitTask's gates: per-tenant limits across replicas, request validation, and the callback SSRF guard."""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
from google.rpc import error_details_pb2

from services.submit.service import start
from services.submit.validation import check_callback_url
from taskgate import store
from taskgate.config import Settings
from taskgate.runtime import Backends
from taskgate_api.v1 import gateway_pb2, gateway_pb2_grpc, task_pb2
from tests.support.factories import key_for
from tests.support.harness import info_of, outcome, violations

# Rate limits


async def test_two_replicas_admit_exactly_max_pending(settings: Settings, backends: Backends) -> None:
    """The tenant itself (no end user) is held to its own limit, exactly, across replicas."""
    md = await key_for(backends, max_pending=3)
    replicas = [await start(settings), await start(settings)]  # each with its own pool and NATS connection
    channels = [grpc.aio.insecure_channel(f"127.0.0.1:{r.port}") for r in replicas]
    try:
        stubs = [gateway_pb2_grpc.TaskGatewayStub(c) for c in channels]
        calls = [
            outcome(stubs[i % 2].SubmitTask(gateway_pb2.SubmitTaskRequest(prompt=f"job {i}"), metadata=md, timeout=10))
            for i in range(20)
        ]
        results = await asyncio.gather(*calls)
    finally:
        for channel in channels:
            await channel.close()
        for replica in replicas:
            await replica.stop(0)
    accepted = [r for code, _, r in results if code == grpc.StatusCode.OK]
    refused = [d for code, d, _ in results if code == grpc.StatusCode.RESOURCE_EXHAUSTED]
    assert len(accepted) == 3 and len(refused) == 17
    assert all(info_of(d).reason == "TOO_MANY_PENDING_TASKS" for d in refused)
    assert {info_of(d).metadata["scope"] for d in refused} == {"tenant"}
    assert await backends.pool.fetchval("SELECT count(*) FROM task") == 3


async def test_finished_tasks_free_pending_slots_and_tenant_limit_wins(stub: Any, backends: Backends) -> None:
    md = await key_for(backends, max_pending=1)
    first = await stub.SubmitTask(gateway_pb2.SubmitTaskRequest(prompt="one"), metadata=md, timeout=5)
    code, details, _ = await outcome(
        stub.SubmitTask(gateway_pb2.SubmitTaskRequest(prompt="two"), metadata=md, timeout=5)
    )
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and info_of(details).metadata["limit"] == "1"
    # an idempotent replay of the pending task still answers with it
    again = await stub.SubmitTask(gateway_pb2.SubmitTaskRequest(prompt="one"), metadata=md, timeout=5)
    assert again.task.id == first.task.id and not again.created
    await store.cancel(backends.pool, int(first.task.id), mode=store.CancelMode.SOFT, actor="test")
    code, _, resp = await outcome(stub.SubmitTask(gateway_pb2.SubmitTaskRequest(prompt="two"), metadata=md, timeout=5))
    assert code == grpc.StatusCode.OK and resp.created


async def test_per_minute_limit_refuses_with_retry_info(stub: Any, backends: Backends) -> None:
    md = await key_for(backends, submits_per_minute=2, max_pending=10)
    await stub.SubmitTask(gateway_pb2.SubmitTaskRequest(prompt="counted"), metadata=md, timeout=5)
    assert await backends.pool.fetchval("SELECT sum(count) FROM rate_window WHERE tenant_id = 'tenant-a'") == 1
    # fill this minute's window and the next, so the test cannot straddle a minute boundary
    await backends.pool.execute(
        "INSERT INTO rate_window (tenant_id, window_start, count) "
        "SELECT 'tenant-a', date_trunc('minute', now()) + make_interval(mins => m), 2 FROM generate_series(0, 1) m "
        "ON CONFLICT (tenant_id, window_start) DO UPDATE SET count = 2"
    )
    before = await backends.pool.fetchval("SELECT count(*) FROM task")
    for request in (gateway_pb2.SubmitTaskRequest(prompt="over"), gateway_pb2.SubmitTaskRequest(prompt=" ")):
        code, details, _ = await outcome(stub.SubmitTask(request, metadata=md, timeout=5))
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and info_of(details).reason == "RATE_LIMITED"
        retry = next(d for d in details if isinstance(d, error_details_pb2.RetryInfo))
        assert 0 < retry.retry_delay.ToTimedelta().total_seconds() <= 60
    assert await backends.pool.fetchval("SELECT count(*) FROM task") == before


async def fill_window(backends: Backends, count: int) -> None:
    """This minute's and the next minute's windows of tenant-a at `count`, so a test cannot straddle a minute."""
    await backends.pool.execute(
        "INSERT INTO rate_window (tenant_id, window_start, count) "
        "SELECT 'tenant-a', date_trunc('minute', now()) + make_interval(mins => m), $1 FROM generate_series(0, 1) m "
        "ON CONFLICT (tenant_id, window_start) DO UPDATE SET count = $1", count,
    )


async def test_a_retry_of_an_accepted_request_gets_its_task_past_every_refusal(stub: Any, backends: Backends) -> None:
    md = await key_for(backends, submits_per_minute=2, max_pending=2)
    plain = gateway_pb2.SubmitTaskRequest(prompt="plain", idempotency_key="k-plain")
    hooked = gateway_pb2.SubmitTaskRequest(prompt="hooked", idempotency_key="k-hook", callback_url="http://127.0.0.1:9/h")
    accepted = [await stub.SubmitTask(r, metadata=md, timeout=5) for r in (plain, hooked)]
    assert all(a.created for a in accepted)
    # the minute window is full and so are the pending slots (2 of 2): a new request is refused ...
    await fill_window(backends, 2)
    code, details, _ = await outcome(
        stub.SubmitTask(gateway_pb2.SubmitTaskRequest(prompt="new"), metadata=md, timeout=5)
    )
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and info_of(details).reason == "RATE_LIMITED"
    # ... and a retry of each accepted one gets its task, alone or in a batch beside a refused item, taking no slot
    # (the one with a callback URL takes its slot before validation: that path too)
    for request, first in zip((plain, hooked), accepted, strict=True):
        again = await stub.SubmitTask(request, metadata=md, timeout=5)
        assert (again.task.id, again.created) == (first.task.id, False)
    both = await stub.SubmitTasks(
        gateway_pb2.SubmitTasksRequest(requests=[hooked, gateway_pb2.SubmitTaskRequest(prompt="new"), plain]),
        metadata=md,
        timeout=5,
    )
    assert [r.WhichOneof("result") for r in both.results] == ["response", "error", "response"]
    assert [both.results[0].response.task.id, both.results[2].response.task.id] == [
        accepted[1].task.id,
        accepted[0].task.id,
    ]
    assert both.results[1].error.code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
    assert await backends.pool.fetchval("SELECT sum(count) FROM rate_window WHERE tenant_id = 'tenant-a'") == 4
    # with room in the window, the pending limit refuses a new request and still answers a retry with its task
    await fill_window(backends, 0)
    code, details, _ = await outcome(
        stub.SubmitTask(gateway_pb2.SubmitTaskRequest(prompt="new"), metadata=md, timeout=5)
    )
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and info_of(details).reason == "TOO_MANY_PENDING_TASKS"
    assert (await stub.SubmitTask(hooked, metadata=md, timeout=5)).task.id == accepted[1].task.id
    # a different request under a used key is told so (its callback URL never resolved), not refused for the rate
    await fill_window(backends, 2)
    other = gateway_pb2.SubmitTaskRequest(prompt="hooked", idempotency_key="k-hook", callback_url="http://10.0.0.1/h")
    code, details, _ = await outcome(stub.SubmitTask(other, metadata=md, timeout=5))
    assert code == grpc.StatusCode.ALREADY_EXISTS and info_of(details).reason == "IDEMPOTENCY_KEY_REUSED"


async def test_rate_windows_are_shared_and_counted_in_postgres(settings: Settings, backends: Backends) -> None:
    md = await key_for(backends, max_pending=50)
    replicas = [await start(settings, backends), await start(settings, backends)]
    channels = [grpc.aio.insecure_channel(f"127.0.0.1:{r.port}") for r in replicas]
    try:
        stubs = [gateway_pb2_grpc.TaskGatewayStub(c) for c in channels]
        await asyncio.gather(
            *(
                outcome(stubs[i % 2].SubmitTask(gateway_pb2.SubmitTaskRequest(prompt=f"j{i}"), metadata=md, timeout=10))
                for i in range(10)
            )
        )
    finally:
        for channel in channels:
            await channel.close()
        for replica in replicas:
            await replica.stop(0)
    assert await backends.pool.fetchval("SELECT sum(count) FROM rate_window WHERE tenant_id = 'tenant-a'") == 10


# Validation


async def test_every_bad_field_is_named(stub: Any, backends: Backends) -> None:
    md = await key_for(backends)
    request = gateway_pb2.SubmitTaskRequest(
        prompt="   ",
        task_type="image-to-sound",
        params=task_pb2.VideoParams(num_frames=8, width=33, height=4096, num_inference_steps=101, guidance_scale=31,
                                    fps=-1, seed=-5, negative_prompt="x\x07"),
        priority=3,  # type: ignore[arg-type]
        metadata={"blob": "x" * 5000},
        callback_url="ftp://example.com/hook",
        callback_events=["FINISHED"],
        max_retries=99,
        idempotency_key=" padded ",
    )
    code, details, _ = await outcome(stub.SubmitTask(request, metadata=md, timeout=5))
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert violations(details) == {
        "prompt", "task_type", "params.num_frames", "params.width", "params.height", "params.num_inference_steps",
        "params.guidance_scale", "params.fps", "params.seed", "params.negative_prompt", "priority", "metadata",
        "callback_url", "callback_events", "max_retries", "idempotency_key",
    }
    assert await backends.pool.fetchval("SELECT count(*) FROM task") == 0






# The SSRF guard




async def test_callback_ssrf_guard_over_grpc(stub: Any, backends: Backends, settings: Settings) -> None:
    md = await key_for(backends)
    for url in ("http://localhost:8080/hook", "http://169.254.169.254/latest/meta-data/"):
        code, details, _ = await outcome(
            stub.SubmitTask(gateway_pb2.SubmitTaskRequest(prompt=url, callback_url=url), metadata=md, timeout=5))
        assert code == grpc.StatusCode.INVALID_ARGUMENT and violations(details) == {"callback_url"}
    ok = await stub.SubmitTask(gateway_pb2.SubmitTaskRequest(prompt="allowed", callback_url="http://127.0.0.1:9/hook"),
                               metadata=md, timeout=5)
    assert ok.created and ok.task.callback_url == "http://127.0.0.1:9/hook"
    assert await check_callback_url("http://93.184.216.34/hook", settings) is None  # a public address
    relaxed = settings.model_copy(update={"callback_allow_hosts": ["LocalHost"]})
    assert await check_callback_url("http://localhost:8080/hook", relaxed) is None


