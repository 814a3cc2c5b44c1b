"""Tracing: one task's spans from the four service processes reach a real OTLP receiver as one trace, parents intact,
each process naming the release (service.version, and taskgate_build_info on its /metrics); off by default; logs and
the SDK carry the context."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.common.v1 import common_pb2
from opentelemetry.proto.trace.v1 import trace_pb2
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from taskgate import auth, bus, telemetry, tracing
from taskgate.config import Settings
from taskgate.runtime import Backends
from taskgate.states import Priority
from taskgate_client import __version__, connect_async, tracecontext
from taskgate_local.embedded import free_port
from tests.support import sleepy
from tests.support.harness import Cluster, wait_for
from tests.support.webhooks import WebhookReceiver

SERVICES = {"taskgate-submit", "taskgate-scheduler", "taskgate-worker", "taskgate-notifier"}


@dataclass(frozen=True, slots=True)
class Collected:
    """One span as a receiver sees it."""

    service: str
    name: str
    trace_id: str
    span_id: str
    parent_id: str
    kind: str
    failed: bool
    attributes: dict[str, Any] = field(hash=False)
    version: str = ""  # the resource's service.version


def _value(value: common_pb2.AnyValue) -> Any:
    kind = value.WhichOneof("value")
    return getattr(value, kind) if kind else None


class Receiver(trace_service_pb2_grpc.TraceServiceServicer):
    """An OTLP/gRPC trace receiver that keeps every span it is sent."""

    def __init__(self) -> None:
        self.spans: list[Collected] = []

    async def Export(
        self, request: trace_service_pb2.ExportTraceServiceRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> trace_service_pb2.ExportTraceServiceResponse:
        for resource_spans in request.resource_spans:
            resource = {a.key: _value(a.value) for a in resource_spans.resource.attributes}
            for scope in resource_spans.scope_spans:
                for s in scope.spans:
                    self.spans.append(
                        Collected(
                            service=str(resource.get("service.name")),
                            name=s.name,
                            trace_id=s.trace_id.hex(),
                            span_id=s.span_id.hex(),
                            parent_id=s.parent_span_id.hex(),
                            kind=trace_pb2.Span.SpanKind.Name(s.kind).removeprefix("SPAN_KIND_"),
                            failed=s.status.code == trace_pb2.Status.STATUS_CODE_ERROR,
                            attributes={a.key: _value(a.value) for a in s.attributes},
                            version=str(resource.get("service.version")),
                        )
                    )
        return trace_service_pb2.ExportTraceServiceResponse()


@pytest.fixture
async def receiver() -> AsyncIterator[tuple[Receiver, int]]:
    server = grpc.aio.server()
    servicer = Receiver()
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        yield servicer, port
    finally:
        await server.stop(0)


def _client_span(span: ReadableSpan) -> Collected:
    ctx = span.get_span_context()
    assert ctx is not None
    return Collected(
        service="test-client", name=span.name, trace_id=f"{ctx.trace_id:032x}", span_id=f"{ctx.span_id:016x}",
        parent_id=f"{span.parent.span_id:016x}" if span.parent else "", kind=span.kind.name, failed=False,
        attributes=dict(span.attributes or {}),
    )


def _named(spans: Iterable[Collected], name: str, service: str | None = None) -> list[Collected]:
    return [s for s in spans if s.name == name and (service is None or s.service == service)]


@pytest.mark.slow
async def test_one_task_is_one_trace_across_the_four_service_processes(
    settings: Settings, backends: Backends, receiver: tuple[Receiver, int], tmp_path: Path
) -> None:
    collector, port = receiver
    base = settings.model_copy(
        update={
            # attempt 1 fails (retried); no worker at first, and the dispatch message is lost (purged below), so the
            # scheduler re-publishes the QUEUED task (a queue that merely waits is not re-published)
            "models": {"sleepy": sleepy.spec(0.2, fail_times=1)},
            "default_model": "sleepy",
            "worker_models": ["sleepy"],
            "worker_slots": 1,
            "queue_timeout_seconds": 1.0,
            "max_republish": 50,
            "scan_interval_seconds": 0.2,
            "retry_backoff_seconds": 0.1,
            "result_inline_max_bytes": 0,  # the output goes to the store, so its span is in the trace
        }
    )
    cluster = Cluster(tmp_path / "cluster", base)
    otel = {
        "OTEL_TRACES_EXPORTER": "otlp",
        "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{port}",
        "OTEL_EXPORTER_OTLP_INSECURE": "true",
        "OTEL_BSP_SCHEDULE_DELAY": "100",
    }
    metrics_ports = {name: free_port() for name in ("submit", "scheduler", "notifier", "worker")}
    for name, metrics_port in metrics_ports.items():
        service = cluster.add(name, f"services.{name}")
        service.env = {k: v for k, v in service.env.items() if not k.startswith("OTEL_")} | otel
        service.env[f"TASKGATE_{name.upper()}_METRICS_PORT"] = str(metrics_port)
    api_key, _ = await auth.create_key(backends.pool, settings.api_key_pepper, "traced")
    provider = TracerProvider(resource=Resource.create({"service.name": "test-client"}))
    mine = InMemorySpanExporter()
    provider.add_span_processor(SimpleSpanProcessor(mine))
    try:
        async with WebhookReceiver() as hooks:
            await cluster.start("submit", "scheduler", "notifier")
            # the unary SubmitTask: its server span is the task's. Over SubmitStream (the SDK's default) each item's
            # span continues its caller's trace, but the long-lived stream's own server span belongs to no one task
            async with connect_async(cluster["submit"].address, api_key, submit_stream=False) as client:
                with provider.get_tracer("test").start_as_current_span("client submit"):
                    task = await client.submit("a traced fox", "sleepy", steps=2, callback_url=hooks.url())
                task_id = int(task.task_id)

            # followed in the database, not with more calls: each call would be a trace of its own
            async def queued() -> bool:
                return bool(await backends.pool.fetchval("SELECT status = 'QUEUED' FROM task WHERE id = $1", task_id))

            await wait_for(queued, 30)
            await backends.bus.js.purge_stream(bus.TASKS_STREAM, subject=bus.task_subject("sleepy", Priority.NORMAL))

            async def republished() -> bool:
                return bool(await backends.pool.fetchval("SELECT publish_count FROM task WHERE id = $1", task_id))

            async def succeeded() -> bool:
                return bool(
                    await backends.pool.fetchval("SELECT status = 'SUCCEEDED' FROM task WHERE id = $1", task_id)
                )

            await wait_for(republished, 30)
            await cluster.start("worker")
            await wait_for(succeeded, 60)
            await wait_for(lambda: bool(hooks.requests), 30)

            def complete() -> bool:
                spans = collector.spans
                names = {(s.service, s.name) for s in spans}
                republishes = {s.span_id for s in _named(spans, "dispatch republished")}
                return (
                    {s.service for s in spans} >= SERVICES
                    and ("taskgate-notifier", "webhook task.succeeded") in names
                    and len(_named(spans, "attempt")) >= 2
                    and ("taskgate-worker", "store") in names
                    and any(s.parent_id in republishes for s in _named(spans, "worker dispatch"))
                )

            await wait_for(complete, 30)
            async with httpx.AsyncClient() as http:
                for port in metrics_ports.values():
                    scraped = (await http.get(f"http://127.0.0.1:{port}/metrics")).text
                    assert f'taskgate_build_info{{version="{__version__}"}} 1.0' in scraped
    finally:
        cluster.stop()

    spans = [*collector.spans, *(_client_span(s) for s in mine.get_finished_spans())]
    [root] = _named(spans, "client submit")
    stray = [(s.service, s.name, s.kind, s.attributes) for s in spans if s.trace_id != root.trace_id]
    assert stray == [], f"every span is in the client's trace: {stray!r}"
    by_id = {s.span_id: s for s in spans}
    assert [s.name for s in spans if s.parent_id not in by_id] == ["client submit"], "one root; every parent is there"
    assert {s.service for s in spans} == SERVICES | {"test-client"}
    assert {s.version for s in collector.spans} == {__version__}, "every service's resource names this release"

    # the submit's server span continues the client's; the dispatches and the re-publish continue the submit's
    [rpc] = [s for s in spans if s.service == "taskgate-submit" and s.kind == "SERVER"]
    assert rpc.parent_id == root.span_id
    [sent] = _named(spans, "dispatch submitted", "taskgate-submit")
    assert sent.parent_id == rpc.span_id and sent.kind == "PRODUCER"
    republished_spans = _named(spans, "dispatch republished", "taskgate-scheduler")
    assert republished_spans and all(s.parent_id == rpc.span_id for s in republished_spans), "from the row's context"
    assert any(s.service == "taskgate-submit" and s.kind == "CLIENT" and s.parent_id == rpc.span_id for s in spans), (
        "asyncpg"
    )

    # each delivery the worker took is a child of the dispatch that sent it; the retried attempt failed, the next one
    # ran
    deliveries = _named(spans, "worker dispatch", "taskgate-worker")
    assert all(by_id[d.parent_id].name.startswith("dispatch ") for d in deliveries)
    attempts = sorted(_named(spans, "attempt", "taskgate-worker"), key=lambda s: s.attributes["taskgate.attempt"])
    assert [(a.attributes["taskgate.attempt"], a.failed) for a in attempts] == [(1, True), (2, False)]
    assert attempts[0].attributes["taskgate.outcome"] == "retried"
    assert all(by_id[a.parent_id].name == "worker dispatch" for a in attempts)
    assert all(by_id[s.parent_id].name == "attempt" for s in [*_named(spans, "denoise"), *_named(spans, "store")])
    assert {s.name for s in spans if s.parent_id == attempts[1].span_id} >= {"denoise", "encode", "store"}

    # the relay's span for the terminal event, the webhook that continues it, and its POST with a traceparent header
    [relayed] = _named(spans, "relay SUCCEEDED", "taskgate-notifier")
    [hook] = _named(spans, "webhook task.succeeded", "taskgate-notifier")
    assert hook.parent_id == relayed.span_id
    [post] = [s for s in spans if s.parent_id == hook.span_id and s.kind == "CLIENT"]  # httpx's span
    traceparent = hooks.requests[0].headers["traceparent"]
    assert traceparent.split("-")[1] == root.trace_id and traceparent.split("-")[2] == post.span_id

    # the worker's log lines inside the trace carry its ids
    lines = [json.loads(line) for line in cluster["worker"].log_path.read_text().splitlines() if line.startswith("{")]
    handled = [line for line in lines if line.get("msg") == "task handled" and line.get("task_id") == str(task_id)]
    assert handled and all(line["trace_id"] == root.trace_id for line in handled)


def test_off_unless_the_otel_variables_ask_for_it() -> None:
    assert tracing.exporters_wanted({}) == []
    assert tracing.exporters_wanted({"OTEL_SERVICE_NAME": "x"}) == []
    assert tracing.exporters_wanted({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4317"}) == ["otlp"]
    assert tracing.exporters_wanted({"OTEL_TRACES_EXPORTER": "otlp,console"}) == ["otlp", "console"]
    assert (
        tracing.exporters_wanted({"OTEL_TRACES_EXPORTER": "none", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4317"}) == []
    )
    assert tracing.exporters_wanted({"OTEL_TRACES_EXPORTER": "otlp", "OTEL_SDK_DISABLED": "true"}) == []
    # off in this process: no span, no header, no carrier
    assert not tracing.enabled()
    with tracing.span("nothing", parent={"traceparent": "00-" + "1" * 32 + "-" + "2" * 16 + "-01"}) as span:
        assert span is None
    assert tracing.carrier() is None and tracing.headers({"a": "b"}) == {"a": "b"}


def test_log_lines_and_the_sdk_carry_the_current_span() -> None:
    provider = TracerProvider()
    record = logging.LogRecord("taskgate.test", logging.INFO, __file__, 1, "hello", None, None)
    formatter = telemetry.JsonFormatter("test")
    assert "trace_id" not in json.loads(formatter.format(record)) and tracecontext.metadata() == ()
    with provider.get_tracer("test").start_as_current_span("call") as span:
        line = json.loads(formatter.format(record))
        metadata = dict(tracecontext.metadata())
    ctx = span.get_span_context()
    assert (line["trace_id"], line["span_id"]) == (f"{ctx.trace_id:032x}", f"{ctx.span_id:016x}")
    assert metadata["traceparent"].split("-")[1:3] == [f"{ctx.trace_id:032x}", f"{ctx.span_id:016x}"]


async def test_the_sync_client_sends_the_calling_threads_span() -> None:
    """The blocking client runs calls on its own loop thread: the caller's span must still reach the metadata."""
    from taskgate_client.sync import _LoopThread

    provider = TracerProvider()
    runner = _LoopThread()

    async def sent() -> tuple[tuple[str, str], ...]:
        return tracecontext.metadata()

    try:
        with provider.get_tracer("test").start_as_current_span("call") as span:
            metadata = await asyncio.to_thread(runner.run, sent())
    finally:
        runner.stop()
    assert dict(metadata)["traceparent"].split("-")[2] == f"{span.get_span_context().span_id:016x}"
