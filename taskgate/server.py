"""gRPC server plumbing shared by every service: one interceptor, health, reflection, TLS, limits."""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import Any

import asyncpg
import grpc
from google.protobuf.message import DecodeError
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from nats.errors import Error as NatsError

from taskgate import errors, loops, telemetry, text, throttle, tracing
from taskgate.bus import Bus
from taskgate.config import CommonSettings
from taskgate.runtime import stop_tasks
from taskgate.store import ping
from taskgate_api import reasons

log = logging.getLogger("taskgate.rpc")

# Failures of our backends: the caller should retry, not see an internal error.
BACKEND_ERRORS: tuple[type[BaseException], ...] = (
    asyncpg.PostgresConnectionError,
    asyncpg.CannotConnectNowError,
    asyncpg.InterfaceError,
    asyncpg.exceptions.ConnectionDoesNotExistError,
    asyncpg.exceptions.TooManyConnectionsError,
    asyncpg.exceptions.AdminShutdownError,  # the server is shutting down
    asyncpg.exceptions.CrashShutdownError,
    ConnectionError,
    OSError,
    NatsError,
    asyncio.TimeoutError,
)

# Values PostgreSQL (or its driver) cannot take: too large for their column, malformed for their type. They are the
# caller's input, never a reason to retry — ahead of BACKEND_ERRORS, where the driver's DataError (an InterfaceError)
# would otherwise land. Requests are range-checked field by field first; this is the net under those checks.
DATA_ERRORS: tuple[type[BaseException], ...] = (asyncpg.exceptions._base.DataError, asyncpg.DataError, OverflowError)

# Calls gRPC core may hold before the application takes them (see start_server).
PENDING_CALLS = 100_000

# Races between concurrent writers (two processes' ids or keys meeting on a unique index, a deadlock, a serialization
# failure): nothing is written, and the same request sent again succeeds, so the caller hears ABORTED + RetryInfo.
CONFLICT_ERRORS: tuple[type[BaseException], ...] = (
    asyncpg.exceptions.UniqueViolationError,
    asyncpg.exceptions.ExclusionViolationError,
    asyncpg.exceptions.DeadlockDetectedError,
    asyncpg.exceptions.SerializationError,
)


def connection_grace(settings: CommonSettings) -> float:
    """How long calls on a connection closed for its age get: the configured grace, or longer when a stream opened
    just before the close needs longer to reach its own maximum age."""
    return max(
        settings.grpc_max_connection_age_grace_seconds,
        settings.stream_max_age_seconds + 2 * settings.stream_keepalive_seconds,
    )


def _split(method: str) -> tuple[str, str]:
    _, service, name = method.split("/", 2)
    return service.rsplit(".", 1)[-1], name


def _request_id(details: grpc.HandlerCallDetails) -> str:
    for key, value in details.invocation_metadata or ():
        if key == "x-request-id" and isinstance(value, str) and 0 < len(value) <= 128:
            return value
    return uuid.uuid4().hex[:16]


def as_api_error(exc: BaseException, method: str) -> errors.ApiError:
    """The status a caller hears for an exception (logged as _to_status logs it); never a stack trace or SQL. One
    item of a stream (SubmitStream) is answered with it while the stream goes on."""
    if isinstance(exc, errors.ApiError):
        return exc
    if isinstance(exc, DATA_ERRORS):
        log.warning("value out of range", extra={"method": method, "error": type(exc).__name__})
        return errors.invalid_argument([("request", "a value is out of range")])
    if isinstance(exc, BACKEND_ERRORS):
        log.warning("backend unavailable", extra={"method": method, "error": type(exc).__name__})
        return errors.unavailable("a backend is unavailable; retry")
    if isinstance(exc, CONFLICT_ERRORS):
        log.warning("write conflict", extra={"method": method, "error": type(exc).__name__})
        return errors.aborted(reasons.CONFLICT, "a concurrent write conflicted; retry")
    log.error("unhandled error", exc_info=exc, extra={"method": method})
    return errors.internal(telemetry.request_id.get())


async def _to_status(exc: BaseException, context: grpc.aio.ServicerContext, method: str) -> None:
    """Maps an exception to the status the caller sees; never leaks a stack trace or SQL."""
    await context.abort_with_status(as_api_error(exc, method).to_status())


class _Undecodable:
    """A request whose strings are not UTF-8: answered INVALID_ARGUMENT naming them, not INTERNAL."""

    def __init__(self, fields: list[str]) -> None:
        self.fields = fields

    def error(self) -> errors.ApiError:
        return errors.invalid_argument([(f, "is not valid UTF-8 (a lone surrogate?)") for f in self.fields])


def _lenient(deserialize: Callable[[bytes], Any] | None) -> Callable[[bytes], Any] | None:
    """The handler's deserializer, returning an _Undecodable for a message whose only fault is a bad string."""
    descriptor = getattr(getattr(deserialize, "__self__", None), "DESCRIPTOR", None)
    if deserialize is None or descriptor is None:
        return deserialize
    parse = deserialize

    def wrapped(data: bytes) -> Any:
        try:
            return parse(data)
        except DecodeError:
            fields = text.undecodable_fields(descriptor, data)
            if not fields:
                raise
            return _Undecodable(fields)

    return wrapped


def _decoded(request: Any) -> Any:
    if isinstance(request, _Undecodable):
        raise request.error()
    return request


def _serialized(serialize: Callable[[Any], bytes] | None) -> Callable[[Any], bytes]:
    """A streamed response to the bytes gRPC sends: a message serialized, bytes (a constant, e.g. a keep-alive
    serialized once) as they are."""
    encode = serialize

    def serialized(item: Any) -> bytes:
        return item if isinstance(item, bytes) or encode is None else encode(item)

    return serialized


async def _failed(exc: Exception, context: grpc.aio.ServicerContext, method: str) -> None:
    """An exception out of a handler as the status the caller hears (an abort has sent its own already)."""
    if not isinstance(exc, grpc.aio.AbortError):
        await _to_status(exc, context, method)


def _finished(context: grpc.aio.ServicerContext, service: str, method: str, start: float) -> None:
    """One call's metrics and, when it failed, its log line."""
    code = context.code() or grpc.StatusCode.OK
    name = code.name if isinstance(code, grpc.StatusCode) else str(code)
    telemetry.GRPC_REQUESTS.labels(service, method, name).inc()
    telemetry.GRPC_LATENCY.labels(service, method).observe(time.perf_counter() - start)
    if name != "OK":
        log.info("rpc failed", extra={"method": method, "code": name})


async def _requests(stream: AsyncIterator[Any]) -> AsyncIterator[Any]:
    async for request in stream:
        yield _decoded(request)


def _wrapped(handler: grpc.RpcMethodHandler, full_method: str) -> grpc.RpcMethodHandler:
    """`handler` with a status for every exception, metrics and a log line per failed call: built once per method,
    so a call holds no wrapper of its own (10,000 open streams each held ~2.5 KiB of closures built per call)."""
    service, method = _split(full_method)
    deserializer = _lenient(handler.request_deserializer)
    if handler.unary_unary is not None:
        inner_uu = handler.unary_unary

        async def unary_unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
            start = time.perf_counter()
            try:
                with throttle.call_scope():  # the place its tenant's call takes (taskgate.throttle) ends with it
                    return await inner_uu(_decoded(request), context)
            except Exception as exc:
                await _failed(exc, context, method)
                raise
            finally:
                _finished(context, service, method, start)

        return grpc.unary_unary_rpc_method_handler(
            unary_unary, request_deserializer=deserializer, response_serializer=handler.response_serializer
        )
    if handler.unary_stream is not None:
        inner_us = handler.unary_stream
        serialize = _serialized(handler.response_serializer)

        async def unary_stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
            start = time.perf_counter()
            try:
                stream = inner_us(_decoded(request), context)
                while True:
                    try:
                        item = await anext(stream)
                    except StopAsyncIteration:
                        break
                    # sent as bytes: what gRPC keeps of it until the next item is that, not the message
                    yield serialize(item)
                    del item  # an idle stream holds none of what it sent
            except Exception as exc:
                await _failed(exc, context, method)
                raise
            finally:
                _finished(context, service, method, start)

        return grpc.unary_stream_rpc_method_handler(unary_stream, request_deserializer=deserializer)
    if handler.stream_unary is not None:
        inner_su = handler.stream_unary

        async def stream_unary(stream: AsyncIterator[Any], context: grpc.aio.ServicerContext) -> Any:
            start = time.perf_counter()
            try:
                return await inner_su(_requests(stream), context)
            except Exception as exc:
                await _failed(exc, context, method)
                raise
            finally:
                _finished(context, service, method, start)

        return grpc.stream_unary_rpc_method_handler(
            stream_unary, request_deserializer=deserializer, response_serializer=handler.response_serializer
        )
    if handler.stream_stream is not None:
        inner_ss = handler.stream_stream

        async def stream_stream(stream: AsyncIterator[Any], context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            start = time.perf_counter()
            try:
                async for item in inner_ss(_requests(stream), context):
                    yield item
            except Exception as exc:
                await _failed(exc, context, method)
                raise
            finally:
                _finished(context, service, method, start)

        return grpc.stream_stream_rpc_method_handler(
            stream_stream, request_deserializer=deserializer, response_serializer=handler.response_serializer
        )
    return handler


class ServerInterceptor(grpc.aio.ServerInterceptor):
    """Request ids, metrics, one log line per failed call, and error mapping, for every RPC."""

    def __init__(self) -> None:
        self._wrapped: dict[str, tuple[grpc.RpcMethodHandler, grpc.RpcMethodHandler]] = {}  # per method

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or method.startswith(("/grpc.health", "/grpc.reflection")):
            return handler
        # the handler runs in this very task (gRPC's one task per call), in this context: its logs carry the id
        telemetry.request_id.set(_request_id(handler_call_details))
        known = self._wrapped.get(method)
        if known is None or known[0] is not handler:
            known = self._wrapped[method] = (handler, _wrapped(handler, method))
        return known[1]


def _credentials(settings: CommonSettings) -> grpc.ServerCredentials | None:
    if settings.tls_cert_file is None or settings.tls_key_file is None:
        return None
    chain = [(settings.tls_key_file.read_bytes(), settings.tls_cert_file.read_bytes())]
    if settings.tls_client_ca_file is not None:
        return grpc.ssl_server_credentials(
            chain, root_certificates=settings.tls_client_ca_file.read_bytes(), require_client_auth=True
        )
    return grpc.ssl_server_credentials(chain)


LIVENESS = ""  # the health service's name for "the process is alive and its loops turn"
READINESS = "taskgate.ready"  # "send it work": PostgreSQL answers, NATS is connected, the process is not draining

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


@dataclass
class Probes:
    """What a service's health is made of: its backends and state for readiness, its own loops for liveness."""

    pool: asyncpg.Pool | None = None
    bus: Bus | None = None
    draining: Callable[[], bool] = lambda: False
    loops: Callable[[], Iterable[asyncio.Task[Any]]] = lambda: ()


class Health:
    """The gRPC health service's answers, re-checked every health_check_seconds: LIVENESS, and READINESS (which each
    served API's own name follows) — so a database or NATS outage or a drain takes a pod out of its Service without
    its liveness probe restarting it."""

    def __init__(
        self, servicer: health.aio.HealthServicer, names: list[str], probes: Probes, settings: CommonSettings
    ) -> None:
        self.servicer = servicer
        self.names = names
        self.probes = probes
        self.settings = settings
        self.ready: bool | None = None
        self.live: bool | None = None
        self._loop: asyncio.Task[None] | None = None
        self.plain: grpc.aio.Server | None = None  # the plaintext health-only server (grpc_health_port)
        self.plain_port = 0

    async def _backends_answer(self) -> bool:
        if self.probes.bus is not None and not self.probes.bus.nc.is_connected:
            return False
        pool = self.probes.pool
        # every connection in use means queries are being answered: a ping would queue behind them and time out
        if pool is not None and (pool.get_idle_size() or pool.get_size() < pool.get_max_size()):
            try:
                async with asyncio.timeout(self.settings.health_check_timeout_seconds):
                    await ping(pool)
            except (*BACKEND_ERRORS, asyncpg.PostgresError):
                return False
        return True

    async def check(self) -> None:
        """One evaluation of both probes; a change is logged."""
        live = not any(loop.done() for loop in self.probes.loops())
        ready = live and not self.probes.draining() and await self._backends_answer()
        if (live, ready) != (self.live, self.ready):
            log.log(logging.INFO if ready else logging.WARNING, "health changed", extra={"live": live, "ready": ready})
        self.live, self.ready = live, ready
        await self.servicer.set(LIVENESS, SERVING if live else NOT_SERVING)
        for name in [READINESS, *self.names]:
            await self.servicer.set(name, SERVING if ready else NOT_SERVING)

    async def _run(self) -> None:
        await loops.repeat(
            self.check,
            every=self.settings.health_check_seconds,
            wait_first=True,
            log=log,
            failed="health check failed",
            level=logging.ERROR,
            traceback=True,
        )

    async def start(self) -> None:
        await self.check()
        self._loop = asyncio.create_task(self._run(), name="health")

    async def stop_checking(self) -> None:
        """Ends the re-checks (a crash in tests: the answers stay as they were)."""
        if self._loop is not None:
            await stop_tasks([self._loop])

    async def shutdown(self) -> None:
        """First stage of a stop: every answer NOT_SERVING, for good, so load balancers stop sending work."""
        await self.stop_checking()
        await self.servicer.enter_graceful_shutdown()
        if self.plain is not None:
            await self.plain.stop(0)


async def start_server(
    settings: CommonSettings,
    port: int,
    register: Callable[[grpc.aio.Server], Iterable[str]],
    probes: Probes | None = None,
) -> tuple[grpc.aio.Server, int, Health]:
    """Starts a server with the given servicers plus health and reflection; returns it, its bound port and its health.

    `register` adds the servicers and returns their full service names (e.g. "taskgate.v1.TaskGateway"); `probes` say
    what readiness and liveness check (LIVENESS and READINESS, re-checked every health_check_seconds).
    """
    limit = settings.grpc_max_message_bytes
    server = grpc.aio.server(
        interceptors=[*tracing.server_interceptors(), ServerInterceptor()],
        options=[
            ("grpc.max_receive_message_length", limit),
            ("grpc.max_send_message_length", max(limit, 4 * 1024 * 1024)),
            ("grpc.so_reuseport", 1),
            ("grpc.keepalive_time_ms", 30_000),
            ("grpc.http2.max_pings_without_data", 0),
            ("grpc.keepalive_permit_without_calls", 1),
            # clients' keepalive pings, also on idle connections, are welcome (gRPC's default 5 min ends in GOAWAY
            # too_many_pings for a client pinging every 30 s)
            ("grpc.http2.min_ping_interval_without_data_ms", int(settings.grpc_min_ping_interval_seconds * 1000)),
            # a connection ends after its age (gRPC adds ±10% jitter), so long-lived clients spread over new pods
            ("grpc.max_connection_age_ms", int(settings.grpc_max_connection_age_seconds * 1000)),
            # a stream still open then is cut off with no status: the grace lets the streams end themselves first
            # (at their own maximum age, noticed within a keep-alive period), with a reason and where to resume
            ("grpc.max_connection_age_grace_ms", int(connection_grace(settings) * 1000)),
            # calls that arrive faster than the event loop takes them wait in gRPC core, which above 1,000 waiting
            # (its default) cancels some at random with a bare CANCELLED before any handler runs: no status, no
            # reason (2,000 WatchTask streams opened at once lost ~10% that way); here they wait until it takes them
            ("grpc.server.max_pending_requests", PENDING_CALLS),
            ("grpc.server.max_pending_requests_hard_limit", PENDING_CALLS),
        ],
    )
    creds = _credentials(settings)
    if creds is None and not is_loopback(settings.grpc_host) and not settings.grpc_allow_plaintext:
        raise PlaintextRefused(
            f"refusing to serve gRPC without TLS on {settings.grpc_host}: set TASKGATE_TLS_CERT_FILE and "
            "TASKGATE_TLS_KEY_FILE, or TASKGATE_GRPC_ALLOW_PLAINTEXT=true where the network itself is trusted"
        )
    names = list(register(server))
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection([*names, health.SERVICE_NAME, reflection.SERVICE_NAME], server)
    address = f"{settings.grpc_host}:{port}"
    bound = server.add_secure_port(address, creds) if creds else server.add_insecure_port(address)
    await server.start()
    probe = Health(health_servicer, names, probes or Probes(), settings)
    if settings.grpc_health_port is not None:
        probe.plain, probe.plain_port = await _health_only(settings, health_servicer)
    await probe.start()
    telemetry.export_limits(settings)
    log.info("grpc server started", extra={"address": f"{settings.grpc_host}:{bound}", "services": names})
    return server, bound, probe


class PlaintextRefused(Exception):
    """A gRPC server asked to serve plaintext on an address other hosts reach, without the setting that allows it."""


def is_loopback(host: str) -> bool:
    """Whether `host` (a bind address) is reachable from this host only."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


async def _health_only(settings: CommonSettings, servicer: health.aio.HealthServicer) -> tuple[grpc.aio.Server, int]:
    """A plaintext server with the health service alone, on grpc_health_port: kubelet's gRPC probes speak no TLS, and
    health answers (SERVING or not) are the one thing worth no secret."""
    plain = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
    health_pb2_grpc.add_HealthServicer_to_server(servicer, plain)
    port = plain.add_insecure_port(f"{settings.grpc_host}:{settings.grpc_health_port}")
    await plain.start()
    return plain, port


async def mark_not_serving(probe: Health) -> None:
    """First stage of shutdown: readiness and liveness fail so load balancers stop sending work."""
    await probe.shutdown()
