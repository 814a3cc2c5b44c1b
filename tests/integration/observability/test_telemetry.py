"""Structured logs and metric hygiene: JSON lines with request ids and extras, one line per transition without the
prompt, request ids on every RPC log line, bounded metric labels in base units."""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import re
import sys
from collections.abc import AsyncIterator, Iterator
from typing import Any, NamedTuple, cast

import grpc
import pytest
from prometheus_client import REGISTRY, Gauge, Histogram
from prometheus_client.metrics import MetricWrapperBase

from taskgate import errors, server, store, telemetry
from taskgate.config import ModelSpec, Settings
from taskgate.states import Status
from taskgate.store.workers import Verdict
from taskgate_api.v1 import events_pb2, task_pb2
from tests.support.factories import claim, insert_task

# Labels that would make a series per task, tenant, request or worker process: never allowed.
UNBOUNDED_LABELS = {
    "task_id",
    "user_id",
    "tenant",
    "tenant_id",
    "request_id",
    "worker_id",
    "worker",
    "id",
    "prompt",
    "uri",
    "url",
}
# Histograms that count things rather than time.
COUNT_HISTOGRAMS = {"taskgate_callback_attempts_per_delivery"}


class Lines(logging.Handler):
    """Formats each record as it is emitted (inside the caller's context, as a stream handler does) and keeps it."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.setFormatter(telemetry.JsonFormatter("test"))
        self.lines: list[dict[str, Any]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(json.loads(self.format(record)))

    def messages(self, msg: str) -> list[dict[str, Any]]:
        return [line for line in self.lines if line["msg"] == msg]


@pytest.fixture
def lines() -> Iterator[Lines]:
    root = logging.getLogger()
    handler, level = Lines(), root.level
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    try:
        yield handler
    finally:
        root.removeHandler(handler)
        root.setLevel(level)


def record(msg: str, **extra: Any) -> logging.LogRecord:
    return logging.getLogger("taskgate.test").makeRecord(
        "taskgate.test", logging.INFO, __file__, 1, msg, (), None, extra=extra
    )


def test_json_formatter_writes_request_id_and_extra_fields() -> None:
    formatter = telemetry.JsonFormatter("submit")
    token = telemetry.request_id.set("req-123")
    try:
        out = json.loads(formatter.format(record("task accepted", task_id="42", model="wan-tiny", attempt=2)))
    finally:
        telemetry.request_id.reset(token)
    assert out["request_id"] == "req-123"
    assert (out["service"], out["level"], out["logger"], out["msg"]) == (
        "submit",
        "info",
        "taskgate.test",
        "task accepted",
    )
    assert (out["task_id"], out["model"], out["attempt"]) == ("42", "wan-tiny", 2)
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", out["ts"])

    outside = json.loads(formatter.format(record("scan pass")))
    assert "request_id" not in outside


def test_json_formatter_keeps_one_line_for_exceptions_and_odd_values() -> None:
    try:
        raise ValueError("bad\nthing")
    except ValueError:
        rec = record("failed", path=object())
        rec.exc_info = sys.exc_info()
    text = telemetry.JsonFormatter("worker").format(rec)
    assert "\n" not in text
    out = json.loads(text)
    assert "ValueError: bad" in out["exc"] and out["path"].startswith("<object")


def test_configure_logging_sets_the_level_and_json_handler() -> None:
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    try:
        telemetry.configure_logging("scheduler", "WARNING")
        assert root.level == logging.WARNING
        assert len(root.handlers) == 1 and isinstance(root.handlers[0].formatter, telemetry.JsonFormatter)
        assert logging.getLogger("nats").getEffectiveLevel() >= logging.WARNING
    finally:
        root.handlers[:] = handlers
        root.setLevel(level)


async def test_each_transition_logs_one_json_line_without_the_prompt(database_url: str, lines: Lines) -> None:
    prompt = "a secret storyboard about a lighthouse keeper named Ostrava"
    pool = await store.create_pool(database_url, 2)
    try:
        task = await insert_task(pool, prompt=prompt)
        queued = await store.queue(pool, task.id, actor="submit", reason="published")
        taken = await claim(pool, task.id, worker_id="w-1", lease_seconds=10.0)
        refused = await store.queue(pool, task.id, actor="submit", reason="late")
    finally:
        await pool.close()
    assert queued.applied and taken.verdict is Verdict.CLAIMED and not refused.applied

    moves = lines.messages("transition")
    assert len(moves) == 2, "one line per applied transition, none for a refused one"
    first, second = moves
    assert (first["task_id"], first["from"], first["to"], first["reason"]) == (
        str(task.id),
        "CREATED",
        "QUEUED",
        "published",
    )
    assert (second["from"], second["to"], second["worker"], second["attempt"], second["actor"]) == (
        Status.QUEUED.value, Status.PROCESSING.value, "w-1", 1, "worker",
    )
    text = json.dumps(lines.lines)
    assert "lighthouse" not in text and hashlib.sha256(prompt.encode()).hexdigest() not in text


async def _echo(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
    logging.getLogger("taskgate.test").info("handling", extra={"size": len(request)})
    return request


async def _missing(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
    logging.getLogger("taskgate.test").info("looking up")
    raise errors.not_found()


KEEPALIVE = events_pb2.WatchTaskResponse(keepalive=events_pb2.KeepAlive()).SerializeToString()


async def _stream(request: bytes, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
    yield events_pb2.WatchTaskResponse(snapshot=task_pb2.Task(id="7"))
    yield KEEPALIVE  # a constant serialized once: sent as it is


def _register(srv: grpc.aio.Server) -> list[str]:
    srv.add_generic_rpc_handlers(
        (
            grpc.method_handlers_generic_handler(
                "test.v1.Probe",
                {
                    "Echo": grpc.unary_unary_rpc_method_handler(_echo),
                    "Missing": grpc.unary_unary_rpc_method_handler(_missing),
                    "Stream": grpc.unary_stream_rpc_method_handler(
                        _stream, response_serializer=events_pb2.WatchTaskResponse.SerializeToString
                    ),
                },
            ),
        )
    )
    return ["test.v1.Probe"]


async def test_a_streamed_item_is_sent_serialized_or_as_the_bytes_it_is() -> None:
    srv, port, _ = await server.start_server(Settings(grpc_host="127.0.0.1"), 0, _register)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            call = channel.unary_stream(
                "/test.v1.Probe/Stream", response_deserializer=events_pb2.WatchTaskResponse.FromString
            )
            got = [item async for item in call(b"")]
    finally:
        await srv.stop(None)
    assert [(item.snapshot.id, item.HasField("keepalive")) for item in got] == [("7", False), ("", True)]


class _Details(NamedTuple):
    method: str
    invocation_metadata: tuple[tuple[str, str], ...]


async def test_a_methods_wrapper_is_built_once_and_each_call_gets_its_own_request_id() -> None:
    """The interceptor's wrappers are made once per method (per call, 10,000 open streams each held ~2.5 KiB of
    them); the request id is the call's own, set in the task its handler runs in."""
    interceptor = server.ServerInterceptor()
    handler = grpc.unary_unary_rpc_method_handler(_echo)

    async def continuation(details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler:
        return handler

    async def call(rid: str) -> tuple[grpc.RpcMethodHandler, str | None]:
        details = cast(grpc.HandlerCallDetails, _Details("/test.v1.Probe/Echo", (("x-request-id", rid),)))
        wrapped = await interceptor.intercept_service(continuation, details)
        return wrapped, telemetry.request_id.get()

    (first, first_id), (second, second_id) = [await asyncio.create_task(call(rid)) for rid in ("req-1", "req-2")]
    assert second is first and first is not handler
    assert (first_id, second_id) == ("req-1", "req-2")


async def test_rpc_log_lines_carry_the_request_id_and_calls_are_counted(lines: Lines) -> None:
    settings = Settings(
        grpc_host="127.0.0.1",
        queue_timeout_seconds=99,
        default_model="m1",
        models={"m1": ModelSpec(kind="sleep", queue_timeout_seconds=42), "m2": ModelSpec(kind="sleep")},
    )
    before = (
        REGISTRY.get_sample_value(
            "taskgate_grpc_requests_total", {"service": "Probe", "method": "Missing", "code": "NOT_FOUND"}
        )
        or 0
    )
    srv, port, _ = await server.start_server(settings, 0, _register)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            assert (
                await channel.unary_unary("/test.v1.Probe/Echo")(b"hi", metadata=(("x-request-id", "req-abc"),))
                == b"hi"
            )
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await channel.unary_unary("/test.v1.Probe/Missing")(b"x")
    finally:
        await srv.stop(None)
    assert caught.value.code() == grpc.StatusCode.NOT_FOUND

    assert [line["request_id"] for line in lines.messages("handling")] == ["req-abc"]
    generated = {line.get("request_id") for line in lines.messages("looking up") + lines.messages("rpc failed")}
    assert len(generated) == 1 and re.fullmatch(r"[0-9a-f]{16}", str(next(iter(generated))))
    assert lines.messages("rpc failed")[0]["code"] == "NOT_FOUND"

    after = REGISTRY.get_sample_value(
        "taskgate_grpc_requests_total", {"service": "Probe", "method": "Missing", "code": "NOT_FOUND"}
    )
    assert after == before + 1
    assert REGISTRY.get_sample_value(
        "taskgate_grpc_request_duration_seconds_count", {"service": "Probe", "method": "Echo"}
    )
    # The queue-timeout alert compares each model's oldest QUEUED age with this gauge.
    assert REGISTRY.get_sample_value("taskgate_queue_timeout_seconds", {"model": "m1"}) == 42
    assert REGISTRY.get_sample_value("taskgate_queue_timeout_seconds", {"model": "m2"}) == 99


def _metrics() -> list[MetricWrapperBase]:
    return [m for m in vars(telemetry).values() if isinstance(m, MetricWrapperBase)]


@pytest.mark.parametrize("metric", _metrics(), ids=lambda m: m._name)
def test_metrics_follow_prometheus_conventions(metric: MetricWrapperBase) -> None:
    name: str = metric._name
    labels: tuple[str, ...] = metric._labelnames
    assert name.startswith("taskgate_") and re.fullmatch(r"[a-z][a-z0-9_]*", name)
    assert metric._documentation, f"{name} has no help text"
    assert not set(labels) & UNBOUNDED_LABELS, f"{name}: unbounded labels {set(labels) & UNBOUNDED_LABELS}"
    if isinstance(metric, Histogram) and name not in COUNT_HISTOGRAMS:
        assert name.endswith("_seconds"), f"{name}: a duration histogram is in seconds"
    if isinstance(metric, Gauge) and re.search(r"_(age|lag|timeout|timestamp)(_|$)", name):
        assert name.endswith("_seconds"), f"{name}: time in base units"
    if "bytes" in name or "memory" in name:
        assert name.endswith("_bytes")
