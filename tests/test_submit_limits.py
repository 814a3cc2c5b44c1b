"""SubmitTask's gates: per-tenant limits across replicas, request validation, and the callback SSRF guard."""

from __future__ import annotations

import asyncio
import ipaddress
from collections.abc import Awaitable
from typing import Any

import grpc
import pytest
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from services.submit.service import start
from services.submit.validation import check_callback_url, validate
from taskgate import errors, store
from taskgate.config import Settings
from taskgate.netguard import forbidden_address
from taskgate.runtime import Backends
from taskgate.v1 import gateway_pb2, gateway_pb2_grpc, task_pb2
from tests.factories import key_for


async def outcome(call: Awaitable[Any]) -> tuple[grpc.StatusCode, list[Any], Any]:
    """(code, details, response): OK with the response, or the error code with its google.rpc details."""
    try:
        return grpc.StatusCode.OK, [], await call
    except grpc.aio.AioRpcError as exc:
        status = rpc_status.from_call(exc)
        return exc.code(), errors.details_of(status) if status else [], None


def info_of(details: list[Any]) -> error_details_pb2.ErrorInfo:
    return next(d for d in details if isinstance(d, error_details_pb2.ErrorInfo))


def violations(details: list[Any]) -> set[str]:
    bad = next(d for d in details if isinstance(d, error_details_pb2.BadRequest))
    return {v.field for v in bad.field_violations}


# Rate limits


async def test_two_replicas_admit_exactly_max_pending(settings: Settings, backends: Backends) -> None:
    assert settings.max_pending_per_tenant == 3
    md = await key_for(backends)
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
    assert await backends.pool.fetchval("SELECT count(*) FROM task") == 3


async def test_finished_tasks_free_pending_slots_and_tenant_limit_wins(stub: Any, backends: Backends) -> None:
    md = await key_for(backends, max_pending=1)
    first = await stub.SubmitTask(gateway_pb2.SubmitTaskRequest(prompt="one"), metadata=md, timeout=5)
    code, details, _ = await outcome(stub.SubmitTask(gateway_pb2.SubmitTaskRequest(prompt="two"), metadata=md, timeout=5))
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
    code, details, _ = await outcome(stub.SubmitTask(gateway_pb2.SubmitTaskRequest(prompt="new"), metadata=md, timeout=5))
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and info_of(details).reason == "RATE_LIMITED"
    # ... and a retry of each accepted one gets its task, alone or in a batch beside a refused item, taking no slot
    # (the one with a callback URL takes its slot before validation: that path too)
    for request, first in zip((plain, hooked), accepted, strict=True):
        again = await stub.SubmitTask(request, metadata=md, timeout=5)
        assert (again.task.id, again.created) == (first.task.id, False)
    both = await stub.SubmitTasks(
        gateway_pb2.SubmitTasksRequest(requests=[hooked, gateway_pb2.SubmitTaskRequest(prompt="new"), plain]), metadata=md,
        timeout=5,
    )
    assert [r.WhichOneof("result") for r in both.results] == ["response", "error", "response"]
    assert [both.results[0].response.task.id, both.results[2].response.task.id] == [accepted[1].task.id, accepted[0].task.id]
    assert both.results[1].error.code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
    assert await backends.pool.fetchval("SELECT sum(count) FROM rate_window WHERE tenant_id = 'tenant-a'") == 4
    # with room in the window, the pending limit refuses a new request and still answers a retry with its task
    await fill_window(backends, 0)
    code, details, _ = await outcome(stub.SubmitTask(gateway_pb2.SubmitTaskRequest(prompt="new"), metadata=md, timeout=5))
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
        await asyncio.gather(*(outcome(stubs[i % 2].SubmitTask(gateway_pb2.SubmitTaskRequest(prompt=f"j{i}"), metadata=md,
                                                               timeout=10)) for i in range(10)))
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


@pytest.mark.parametrize(
    ("fields", "field"),
    [
        ({"prompt": "x" * 2001}, "prompt"),
        ({"prompt": "tab\tok but nul\x00 not"}, "prompt"),
        ({"prompt": "ok", "model_id": "no-such-model"}, "model_id"),
        ({"prompt": "ok", "params": task_pb2.VideoParams(num_frames=85)}, "params.num_frames"),
        ({"prompt": "ok", "params": task_pb2.VideoParams(width=1296)}, "params.width"),
        ({"prompt": "ok", "params": task_pb2.VideoParams(guidance_scale=float("nan"))}, "params.guidance_scale"),
        ({"prompt": "ok", "callback_url": "http://user:pw@127.0.0.1/hook"}, "callback_url"),
        ({"prompt": "ok", "callback_events": ["PROGRESS"]}, "callback_events"),
    ],
)
async def test_single_bad_field(settings: Settings, fields: dict[str, Any], field: str) -> None:
    with pytest.raises(errors.ApiError) as info:
        await validate("tenant-a", gateway_pb2.SubmitTaskRequest(**fields), settings)
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert violations(errors.details_of(info.value.status_proto)) == {field}


async def test_valid_edges_are_accepted(settings: Settings) -> None:
    spec = settings.models["wan-tiny"]
    params = task_pb2.VideoParams(num_frames=spec.max_frames, width=spec.max_width, height=16,
                                  num_inference_steps=spec.max_steps, guidance_scale=spec.max_guidance)
    sub = await validate("tenant-a", gateway_pb2.SubmitTaskRequest(prompt="line one\n\tline two", params=params), settings)
    assert sub.payload["num_frames"] == spec.max_frames and sub.priority == 5 and sub.key_derived
    same = await validate("tenant-a", gateway_pb2.SubmitTaskRequest(prompt="line one\n\tline two", params=params), settings)
    other_tenant = await validate("tenant-b", gateway_pb2.SubmitTaskRequest(prompt="line one\n\tline two", params=params),
                                  settings)
    assert sub.idempotency_key == same.idempotency_key == sub.request_hash != other_tenant.idempotency_key


# The SSRF guard


@pytest.mark.parametrize(
    "url",
    [
        "http://localhost:8080/hook",  # a name resolving to 127.0.0.1
        "http://169.254.169.254/latest/meta-data/",
        "http://[fd00:ec2::254]/",
        "http://2130706433/hook",  # 127.0.0.1 as one decimal number
        "http://0x7f.1/hook",
        "http://[::1]:8080/hook",
        "http://[::ffff:127.0.0.1]/hook",
        "http://10.1.2.3/hook",
        "http://192.168.0.10/hook",
        "http://100.100.100.200/hook",
        "http://0.0.0.0/hook",
        "http://224.0.0.1/hook",
        "https://no-such-host.invalid/hook",
        "file:///etc/passwd",
        "http:///no-host",
    ],
)
async def test_callback_urls_refused(settings: Settings, url: str) -> None:
    assert await check_callback_url(url, settings) is not None


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


def test_forbidden_address_ranges() -> None:
    bad = ["127.0.0.1", "10.0.0.1", "172.16.5.4", "192.168.1.1", "169.254.1.1", "169.254.169.254", "100.64.0.1",
           "0.0.0.0", "240.0.0.1", "224.0.0.5", "::1", "::", "fe80::1", "fc00::1", "fd00:ec2::254", "ff02::1",
           "::ffff:10.0.0.1", "192.0.0.8", "fec0::1", "2002:7f00:1::1", "2001:db8::1"]
    good = ["93.184.216.34", "8.8.8.8", "2606:4700:4700::1111"]
    assert all(forbidden_address(ipaddress.ip_address(a)) for a in bad)
    assert not any(forbidden_address(ipaddress.ip_address(a)) for a in good)
