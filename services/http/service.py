"""The HTTP service: the JSON API, its OpenAPI document, health, and the operator dashboard, on uvicorn."""

from __future__ import annotations

import asyncio
import logging
import math
import socket
import time
from dataclasses import dataclass

import grpc
import uvicorn
from grpc_health.v1 import health_pb2, health_pb2_grpc
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from taskgate import telemetry
from taskgate.config import HttpSettings
from taskgate.runtime import serve_until_signal
from taskgate.server import READINESS

from . import dashboard, openapi
from .api import POLL_HEADER, Api
from .oai.routes import Face
from .upstream import Upstream

log = logging.getLogger("taskgate.http")


class Metrics:
    """Counts and times every request by its route's path template (bounded labels) and status code."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        status = {"code": 500}

        async def sending(message: Message) -> None:
            if message["type"] == "http.response.start":
                status["code"] = int(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, sending)
        finally:
            route = scope.get("route")
            template = getattr(route, "path", "unmatched")
            telemetry.HTTP_REQUESTS.labels(scope["method"], template, str(status["code"])).inc()
            telemetry.HTTP_LATENCY.labels(scope["method"], template).observe(time.perf_counter() - started)


async def _ready(channel: grpc.aio.Channel, within: float) -> str:
    """An upstream's readiness as one word: SERVING, NOT_SERVING, or the gRPC code that kept it from answering."""
    try:
        reply = await health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=READINESS), timeout=within
        )
    except grpc.aio.AioRpcError as exc:
        return str(exc.code().name)
    return str(health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status))


def build_app(settings: HttpSettings, upstream: Upstream, closing: asyncio.Event) -> Starlette:
    """The ASGI application over `upstream`: the API, its document, health, and the dashboard."""
    api = Api(upstream, settings, closing)

    async def healthz(_request: Request) -> Response:
        """Liveness: the process answers."""
        return JSONResponse({"status": "SERVING"})

    async def readyz(_request: Request) -> Response:
        """Readiness: not draining, and the upstreams every API call needs (the gateway, the events) answer their own
        readiness (taskgate.ready); 503 names what is not, so a load balancer stops sending to a face that cannot
        serve."""
        if closing.is_set():
            return JSONResponse({"status": "NOT_SERVING", "reason": "draining"}, status_code=503)
        names = ("gateway", "events")
        answers = await asyncio.gather(
            *(_ready(channel, settings.health_check_timeout_seconds) for channel in upstream.channels[:2])
        )
        upstreams = dict(zip(names, answers, strict=True))
        ready = all(answer == "SERVING" for answer in answers)
        return JSONResponse(
            {"status": "SERVING" if ready else "NOT_SERVING", "upstreams": upstreams}, status_code=200 if ready else 503
        )

    async def spec(_request: Request) -> Response:
        return JSONResponse(openapi.document())

    routes: list[BaseRoute] = [
        Route("/healthz", healthz, methods=["GET"]),
        Route("/readyz", readyz, methods=["GET"]),
        Route("/openapi.json", spec, methods=["GET"]),
        *api.routes(),
        *Face(upstream, settings, closing).routes(),
        *dashboard.routes(upstream, settings),
    ]
    middleware = [Middleware(Metrics)]
    if settings.http_cors_origins:  # a page of another origin holding a client token (none unless configured)
        middleware.append(Middleware(
            CORSMiddleware, allow_origins=settings.http_cors_origins, allow_methods=["GET", "POST", "PUT"],
            allow_headers=["authorization", "content-type", "idempotency-key", "last-event-id", "traceparent"],
            expose_headers=[POLL_HEADER, "location", "retry-after"], max_age=600,
        ))
    return Starlette(routes=routes, middleware=middleware)


@dataclass
class HttpHandle:
    """A running HTTP service: its port, and how to stop it."""

    port: int
    app: Starlette
    server: uvicorn.Server
    serving: asyncio.Task[None]
    sockets: list[socket.socket]
    upstream: Upstream
    closing: asyncio.Event
    settings: HttpSettings

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def stop(self, grace: float | None = None) -> None:
        """Ends the event streams, lets requests in flight finish within `grace`, then closes the channels."""
        self.closing.set()
        seconds = self.settings.http_shutdown_grace_seconds if grace is None else grace
        self.server.config.timeout_graceful_shutdown = math.ceil(seconds)
        self.server.should_exit = True
        try:
            await self.serving
            await self.server.shutdown(sockets=self.sockets)
        finally:
            await self.upstream.close()


async def start(settings: HttpSettings) -> HttpHandle:
    """Starts the HTTP service on settings.http_port (0 = ephemeral) in this event loop."""
    upstream = Upstream.connect(settings)
    closing = asyncio.Event()
    app = build_app(settings, upstream, closing)
    sock = socket.socket(socket.AF_INET6 if ":" in settings.http_host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((settings.http_host, settings.http_port))
    except OSError:
        sock.close()
        await upstream.close()
        raise
    config = uvicorn.Config(
        app, log_config=None, access_log=False, lifespan="off", proxy_headers=False, server_header=False,
        timeout_graceful_shutdown=math.ceil(settings.http_shutdown_grace_seconds),
    )
    config.load()
    server = uvicorn.Server(config)
    # Server.serve() would also take over SIGINT/SIGTERM, which the service's own stop_signal() handles: its steps
    # are run here instead (lifespan off: the app has no startup or shutdown of its own)
    server.lifespan = config.lifespan_class(config)
    await server.startup(sockets=[sock])
    serving = asyncio.create_task(server.main_loop(), name="http-main-loop")
    port = int(sock.getsockname()[1])
    log.info("serving", extra={"port": port})
    return HttpHandle(port, app, server, serving, [sock], upstream, closing, settings)


async def main(settings: HttpSettings) -> None:
    """Runs the HTTP service until SIGTERM or SIGINT."""
    await serve_until_signal(lambda: start(settings), grace_seconds=settings.http_shutdown_grace_seconds)
