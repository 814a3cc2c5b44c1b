"""Tracing with OpenTelemetry: one trace per task, across every service; off unless the OTEL_* variables ask for it.

The W3C trace context (a `Carrier`: traceparent, tracestate) travels from the client's call into the task row, the
NATS headers and the webhook requests, and each service continues the task's trace from there. `configure` turns
tracing on (OTEL_TRACES_EXPORTER=otlp|console, or an OTEL_EXPORTER_OTLP_ENDPOINT); until then every function here
returns at its first line: no span, no header, no context object.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Mapping, Sequence
from contextlib import AbstractContextManager
from typing import Any

from opentelemetry import propagate, trace
from opentelemetry.context import Context
from opentelemetry.trace import Span, SpanKind, StatusCode
from opentelemetry.util.types import AttributeValue

from taskgate_api.version import __version__

log = logging.getLogger("taskgate.tracing")

Carrier = dict[str, str]
Attributes = Mapping[str, AttributeValue]
TASK_ID = "taskgate.task_id"

_tracer: trace.Tracer | None = None  # set by configure(): tracing is on
_OFF: AbstractContextManager[None] = contextlib.nullcontext()


def exporters_wanted(env: Mapping[str, str] = os.environ) -> list[str]:
    """The span exporters the OTEL_* variables ask for; none (tracing off) when nothing is configured."""
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return []
    names = env.get("OTEL_TRACES_EXPORTER")
    if names is None:  # the spec's default is otlp; here an endpoint must be named before anything is sent
        endpoint = env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_ENDPOINT")
        return ["otlp"] if endpoint else []
    return [n for n in (part.strip().lower() for part in names.split(",")) if n and n != "none"]


def configure(service: str) -> bool:
    """Installs the SDK's tracer provider, its exporters and the gRPC/asyncpg/httpx instrumentations when the OTEL_*
    variables ask for traces; True when tracing is on. `service` names the resource unless OTEL_SERVICE_NAME does."""
    global _tracer
    wanted = exporters_wanted()
    if not wanted or _tracer is not None:
        return _tracer is not None
    # the SDK and the instrumentations load only here: a process without tracing never imports them
    from opentelemetry.instrumentation.asyncpg import AsyncPGInstrumentor
    from opentelemetry.instrumentation.httpx import HTTPXClientInstrumentor
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SpanExporter

    exporters: list[SpanExporter] = []
    for name in wanted:
        if name == "otlp":
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

            protocol = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or os.environ.get(
                "OTEL_EXPORTER_OTLP_PROTOCOL"
            )
            if protocol not in (None, "", "grpc"):
                log.warning("only OTLP over gRPC is built in; exporting with it", extra={"protocol": protocol})
            exporters.append(OTLPSpanExporter())
        elif name == "console":
            exporters.append(ConsoleSpanExporter())
        else:
            log.error("unknown OTEL_TRACES_EXPORTER entry ignored", extra={"exporter": name})
    if not exporters:
        return False
    resource = Resource.create({"service.name": os.environ.get("OTEL_SERVICE_NAME") or f"taskgate-{service}",
                                "service.version": __version__})
    # OTEL_TRACES_SAMPLER wins when set; the default keeps every trace but those a bare background query would start
    sampler = None if os.environ.get("OTEL_TRACES_SAMPLER") else _default_sampler()
    provider = TracerProvider(resource=resource, sampler=sampler)
    for exporter in exporters:
        provider.add_span_processor(BatchSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
    AsyncPGInstrumentor().instrument()
    HTTPXClientInstrumentor().instrument()
    _tracer = trace.get_tracer("taskgate")
    log.info("tracing on", extra={"exporters": wanted, "service_name": resource.attributes.get("service.name")})
    return True


def _default_sampler() -> Any:
    from opentelemetry.sdk.trace.sampling import Decision, ParentBased, Sampler, SamplingResult

    class SkipStrayQueries(Sampler):
        """Root sampler: drops the trace a database query with no traced work around it would start (a scan's, a
        relay pass's: thousands a minute of one-span traces), keeps every other root."""

        def should_sample(
            self,
            parent_context: Context | None,
            trace_id: int,
            name: str,
            kind: SpanKind | None = None,
            attributes: Attributes | None = None,
            links: Sequence[Any] | None = None,
            trace_state: Any = None,
        ) -> SamplingResult:
            if kind is SpanKind.CLIENT and attributes and ("db.system" in attributes or "db.system.name" in attributes):
                return SamplingResult(Decision.DROP)
            return SamplingResult(Decision.RECORD_AND_SAMPLE, attributes)

        def get_description(self) -> str:
            return "SkipStrayQueries"

    return ParentBased(root=SkipStrayQueries())


def enabled() -> bool:
    """Whether tracing is on in this process."""
    return _tracer is not None


def server_interceptors() -> list[Any]:
    """The gRPC server interceptors that continue the caller's trace (health and reflection calls left out)."""
    if _tracer is None:
        return []
    from opentelemetry.instrumentation.grpc import aio_server_interceptor
    from opentelemetry.instrumentation.grpc.filters import any_of, negate, service_prefix

    return [
        aio_server_interceptor(filter_=negate(any_of(service_prefix("grpc.health"), service_prefix("grpc.reflection"))))
    ]


def _context(parent: Mapping[str, str] | None) -> Context | None:
    """The context a new span starts in: the current one, unless `parent` names another trace (then `parent`)."""
    if not parent:
        return None
    remote = propagate.extract(parent)
    theirs = trace.get_current_span(remote).get_span_context()
    if not theirs.is_valid:
        return None
    mine = trace.get_current_span().get_span_context()
    if mine.is_valid and mine.trace_id == theirs.trace_id:
        return None  # already inside the task's trace: nest under the current span
    return remote


def span(
    name: str,
    *,
    parent: Mapping[str, str] | None = None,
    kind: SpanKind = SpanKind.INTERNAL,
    attributes: Attributes | None = None,
) -> AbstractContextManager[Span | None]:
    """A span made current for a `with` block, in the trace of `parent` (a row's or a message's carrier) or else of
    the current span; it records an exception that ends the block. Off: a shared no-op yielding None."""
    if _tracer is None:
        return _OFF
    return _tracer.start_as_current_span(name, context=_context(parent), kind=kind, attributes=attributes)


def start(
    name: str,
    *,
    parent: Mapping[str, str] | None = None,
    kind: SpanKind = SpanKind.INTERNAL,
    attributes: Attributes | None = None,
) -> Span | None:
    """A span not made current (several at once, ended with `end`); None when off."""
    if _tracer is None:
        return None
    return _tracer.start_span(name, context=_context(parent), kind=kind, attributes=attributes)


def end(started: Span | None, *, error: str | None = None) -> None:
    """Ends a span from `start`, marked failed when `error` is given."""
    if started is not None:
        if error is not None:
            started.set_status(StatusCode.ERROR, error)
        started.end()


def phase(name: str, *, start_ns: int, end_ns: int, attributes: Attributes | None = None) -> None:
    """A finished child of the current span that ran from start_ns to end_ns (time.time_ns()), for phases measured
    inside code that cannot hold a span open (a pipeline's denoising loop); nothing outside a span (a warm-up)."""
    if _tracer is not None and trace.get_current_span().get_span_context().is_valid:
        _tracer.start_span(name, start_time=start_ns, attributes=attributes).end(end_time=max(end_ns, start_ns))


def carrier_of(started: Span | None) -> Carrier | None:
    """A span's context as W3C headers (to store or send); None for None."""
    if started is None:
        return None
    out: Carrier = {}
    propagate.inject(out, context=trace.set_span_in_context(started))
    return out or None


def carrier() -> Carrier | None:
    """The current span's context as W3C headers; None when off or when no span is current."""
    if _tracer is None:
        return None
    out: Carrier = {}
    propagate.inject(out)
    return out or None


def headers(base: dict[str, str]) -> dict[str, str]:
    """`base` (NATS or HTTP headers) with the current span's context added; `base` untouched when off."""
    if _tracer is not None:
        propagate.inject(base)
    return base


def annotate(attributes: Attributes, *, error: str | None = None) -> None:
    """Adds attributes to the current span, and marks it failed when `error` is given."""
    if _tracer is None:
        return
    current = trace.get_current_span()
    current.set_attributes(attributes)
    if error is not None:
        current.set_status(StatusCode.ERROR, error)
