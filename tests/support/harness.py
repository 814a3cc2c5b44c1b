"""A process cluster for tests and benchmarks: embedded servers, service subprocesses to kill and restart, a webhook
receiver."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import importlib.util
import json
import os
import shutil
import signal
import ssl
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import grpc
from google.rpc import error_details_pb2, status_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_status import rpc_status

from taskgate import auth
from taskgate.config import CommonSettings, Settings
from taskgate_api.v1 import admin_pb2_grpc, events_pb2_grpc, gateway_pb2_grpc
from taskgate_client.errors import details_of as details_of  # what a client reads; tests import it from here
from taskgate_local.embedded import EmbeddedNats, EmbeddedPostgres, EmbeddedStack, free_port

ROOT = Path(__file__).resolve().parents[2]

# Which Settings field holds each service module's gRPC port.
PORT_FIELDS = {
    "services.submit": "submit_port",
    "services.notifier": "notifier_port",
    "services.scheduler": "scheduler_port",
    "services.worker": "worker_port",
}


def settings_env(settings: CommonSettings) -> dict[str, str]:
    """Every set field of `settings` as the TASKGATE_* variable a service process reads back into the same value."""
    env: dict[str, str] = {}
    for name, value in settings.model_dump(mode="json").items():
        if value is None:
            continue
        if isinstance(value, (dict, list, tuple)):
            text = json.dumps(value)
        elif isinstance(value, bool):
            text = "true" if value else "false"
        else:
            text = str(value)
        env[f"TASKGATE_{name.upper()}"] = text
    return env


@contextlib.asynccontextmanager
async def worker_process(settings: Settings) -> AsyncIterator[asyncio.subprocess.Process]:
    """A worker in its own process (`python -m services.worker`), killed if the test leaves it running."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TASKGATE_")} | settings_env(settings)
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "services.worker", env=env, cwd=ROOT,
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL,
    )
    try:
        yield proc
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


async def wait_for(condition: Callable[[], Awaitable[bool] | bool], within: float = 10.0, every: float = 0.05) -> None:
    """Polls `condition` until it holds; raises TimeoutError after `within` seconds."""
    deadline = time.monotonic() + within
    while True:
        result = condition()
        if not isinstance(result, bool):
            result = await result
        if result:
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"condition not met within {within}s")
        await asyncio.sleep(every)


def bearer(key: str) -> tuple[tuple[str, str]]:
    """The call metadata carrying `key`."""
    return (("authorization", f"Bearer {key}"),)


@dataclass
class ApiStack:
    """Stubs over real channels to a submit service, a notifier and a scheduler (TaskAdmin) on one set of backends."""

    gateway: gateway_pb2_grpc.TaskGatewayStub
    events: events_pb2_grpc.TaskEventsStub
    admin: admin_pb2_grpc.TaskAdminStub
    admin_port: int


@contextlib.asynccontextmanager
async def api_stack(settings: Settings, backends: Any) -> AsyncIterator[ApiStack]:
    """Starts the three API services (the scheduler without its scan loop), yields their stubs, stops them all."""
    from services.notifier import service as notifier_service
    from services.scheduler import service as scheduler_service
    from services.submit import service as submit_service


    submit = await submit_service.start(settings, backends)
    notifier = await notifier_service.start(settings.model_copy(update={"notifier_port": free_port()}), backends)
    scheduler = await scheduler_service.start(settings, backends, scan_loop=False)
    channels = [grpc.aio.insecure_channel(f"127.0.0.1:{h.port}") for h in (submit, notifier, scheduler)]
    try:
        yield ApiStack(
            gateway_pb2_grpc.TaskGatewayStub(channels[0]), events_pb2_grpc.TaskEventsStub(channels[1]),
            admin_pb2_grpc.TaskAdminStub(channels[2]), scheduler.port,
        )
    finally:
        for channel in channels:
            await channel.close()
        await notifier.stop()
        await scheduler.stop(0)
        await submit.stop(0)


# the `workers` fixture (conftest.py): starts a worker, stopped at the end
WorkerFactory = Callable[..., Awaitable[Any]]


async def stored_objects(bus: Any, prefix: str = "") -> list[str]:
    """The names of the objects the results bucket holds now (deleted ones left out), those starting with `prefix`."""
    from nats.js.errors import NotFoundError

    from taskgate.bus import RESULTS_BUCKET

    try:
        found = await (await bus.js.object_store(RESULTS_BUCKET)).list(ignore_deletes=True)
    except NotFoundError:  # an empty bucket
        return []
    return sorted(o.name for o in found if o.name.startswith(prefix))


def trailing_details(exc: grpc.aio.AioRpcError) -> list[object]:
    """The google.rpc details a failed call carried in its trailing metadata (none: an empty list)."""
    for key, value in exc.trailing_metadata() or ():
        if key == "grpc-status-details-bin" and isinstance(value, bytes):
            return details_of(status_pb2.Status.FromString(value))
    return []


async def serving(address: str, within: float = 1.0) -> bool:
    """Whether a gRPC server at `address` answers its health check with SERVING."""
    async with grpc.aio.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            reply = await stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=within)
        except grpc.aio.AioRpcError:
            return False
        return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)


@dataclass
class ServiceProcess:
    """One `python -m services.<name>` child: started in its own session, logging to a file, killable by group."""

    name: str
    module: str
    env: dict[str, str]
    port: int
    log_path: Path
    proc: subprocess.Popen[bytes] | None = None
    starts: int = 0
    exits: list[int] = field(default_factory=list)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self) -> None:
        """Starts the process (again); its output is appended to its log file."""
        assert not self.alive, f"{self.name} is already running"
        self._reap()
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", self.module],
                env=self.env,
                cwd=ROOT,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.starts += 1

    def kill(self) -> None:
        """SIGKILL, like a crashed machine: nothing is flushed, released or acknowledged."""
        self.signal(signal.SIGKILL)
        if self.proc is not None:
            self.proc.wait()
        self._reap()

    def signal(self, sig: signal.Signals) -> None:
        """Sends `sig` to the whole process group (the service and anything it started)."""
        if self.proc is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, sig)

    def stop(self, timeout: float = 15.0) -> None:
        """SIGTERM, then SIGKILL after `timeout` seconds."""
        if not self.alive:
            self._reap()
            return
        self.signal(signal.SIGTERM)
        assert self.proc is not None
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
        self._reap()

    def _reap(self) -> None:
        if self.proc is not None and self.proc.poll() is not None:
            self.exits.append(self.proc.returncode)
            self.proc = None

    async def wait_serving(self, within: float = 60.0) -> float:
        """Seconds until the process answers its health check; fails early if it exits."""
        start = time.monotonic()

        async def ready() -> bool:
            if not self.alive:
                raise RuntimeError(
                    f"{self.name} exited with {self.proc.returncode if self.proc else '?'}:\n{self.tail()}"
                )
            return await serving(self.address, 0.5)

        await wait_for(ready, within, every=0.05)
        return time.monotonic() - start

    def tail(self, lines: int = 30) -> str:
        """The end of the process's log."""
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])


def nats_cluster(base: Path, nodes: int) -> list[EmbeddedNats]:
    """`nodes` nats-servers routed to each other on loopback, JetStream on each in its own store folder; started."""
    routes = [free_port() for _ in range(nodes)]
    servers = []
    for i, route in enumerate(routes):
        others = ",".join(f"nats://127.0.0.1:{port}" for j, port in enumerate(routes) if j != i)
        args = (
            "-n",
            f"node-{i + 1}",
            "--cluster_name",
            "taskgate",
            "--cluster",
            f"nats://127.0.0.1:{route}",
            "--routes",
            others,
        )
        servers.append(EmbeddedNats(base / f"nats-{i + 1}", args=args))
    for server in servers:
        server.start()
    return servers


class Cluster:
    """An embedded PostgreSQL + NATS of its own (so tests may kill them) and service processes over them.

    With `nats_nodes` > 1 NATS is a cluster of that many nodes, and the settings' nats_url lists them all.
    """

    def __init__(self, state_dir: Path, settings: Settings, nats_nodes: int = 1) -> None:
        self.state_dir = state_dir
        self.base_settings = settings
        self.stack: EmbeddedStack | None = None
        self.services: dict[str, ServiceProcess] = {}
        self.settings = settings
        self.nats_node_count = nats_nodes
        self.nats_nodes: list[EmbeddedNats] = []

    @property
    def postgres(self) -> EmbeddedPostgres:
        assert self.stack is not None and self.stack.postgres is not None
        return self.stack.postgres

    @property
    def nats(self) -> EmbeddedNats:
        assert self.stack is not None and self.stack.nats is not None
        return self.stack.nats

    def start_servers(self) -> Settings:
        """Starts PostgreSQL and NATS; returns the settings pointing at them (also kept as `self.settings`)."""
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self.state_dir.chmod(0o755)
        servers = self.state_dir / "servers"
        if self.nats_node_count == 1:
            self.stack = EmbeddedStack(servers).start()
            nats_url = self.nats.url
        else:
            self.stack = EmbeddedStack(servers, postgres=EmbeddedPostgres(servers / "pg").start())
            self.nats_nodes = nats_cluster(servers, self.nats_node_count)
            nats_url = ",".join(node.url for node in self.nats_nodes)
        self.settings = self.base_settings.model_copy(
            update={"database_url": self.postgres.url, "nats_url": nats_url, "state_dir": self.state_dir}
        )
        return self.settings

    def add(self, name: str, module: str, port_field: str | None = None, **overrides: Any) -> ServiceProcess:
        """Declares a service process; `overrides` are Settings fields for this process only. Not started yet.

        `port_field` names the Settings field holding its gRPC port (known for the four services).
        """
        port_field = port_field or PORT_FIELDS[module]
        port = int(overrides.pop(port_field, 0) or free_port())
        settings = self.settings.model_copy(update={**overrides, port_field: port})
        env = {k: v for k, v in os.environ.items() if not k.startswith("TASKGATE_")}
        env.update(settings_env(settings))
        env.update({"PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1", "HF_HUB_DISABLE_PROGRESS_BARS": "1"})
        logs = self.state_dir / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        service = ServiceProcess(name, module, env, port, logs / f"{name}.log")
        self.services[name] = service
        return service

    def __getitem__(self, name: str) -> ServiceProcess:
        return self.services[name]

    async def start(self, *names: str, within: float = 90.0) -> None:
        """Starts the named services (all when none are named) and waits until each is serving."""
        chosen = [self.services[n] for n in names] if names else list(self.services.values())
        for service in chosen:
            service.start()
        await asyncio.gather(*(s.wait_serving(within) for s in chosen))

    def kill(self, name: str) -> None:
        """SIGKILLs one service."""
        self.services[name].kill()

    async def restart(self, name: str, within: float = 90.0) -> float:
        """Starts a stopped or killed service again; returns the seconds until it serves."""
        service = self.services[name]
        if service.alive:
            service.kill()
        service.start()
        return await service.wait_serving(within)

    def kill_nats(self) -> None:
        """SIGKILLs nats-server; its JetStream store stays on disk."""
        self.nats.kill()

    def start_nats(self) -> None:
        """Starts nats-server again on the same port and store folder."""
        self.nats.start()

    def kill_postgres(self) -> None:
        """An immediate shutdown (like a crash: no checkpoint, recovery on the next start)."""
        self.postgres.kill()

    def start_postgres(self) -> None:
        """Starts PostgreSQL again on the same data folder and socket."""
        url = self.postgres.url
        self.postgres.start()
        if self.postgres.url != url:
            raise RuntimeError(f"postgres came back at {self.postgres.url}, not {url}")

    def stop(self) -> None:
        """Stops every service (SIGTERM, then SIGKILL), then the servers."""
        for service in self.services.values():
            service.signal(signal.SIGTERM)
        for service in self.services.values():
            service.stop(10.0)
        for node in self.nats_nodes:
            node.stop()
        if self.stack is not None:
            self.stack.stop()
            self.stack = None


# ---------------------------------------------------------------- a test CA


@dataclass(frozen=True)
class LocalCA:
    """A certificate authority made for one test run, and a server certificate it signed (for localhost/127.0.0.1
    unless asked for other names)."""

    ca_file: Path
    cert_file: Path
    key_file: Path

    def server_context(self) -> ssl.SSLContext:
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.load_cert_chain(self.cert_file, self.key_file)
        return context


def make_local_ca(folder: Path, names: str = "DNS:localhost,IP:127.0.0.1") -> LocalCA:
    """A CA and a server certificate for `names` (subjectAltName) made with the openssl command (skips the test
    without it)."""
    if shutil.which("openssl") is None:
        import pytest  # the harness also serves the benchmarks, which need no pytest

        pytest.skip("openssl is needed to make a test CA")
    folder.mkdir(parents=True, exist_ok=True)
    ca_key, ca, key, csr, cert = (folder / n for n in ("ca.key", "ca.pem", "server.key", "server.csr", "server.pem"))
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    run = functools.partial(subprocess.run, check=True, capture_output=True)
    run(["openssl", "req", "-x509", *ec, "-days", "2", "-subj", "/CN=taskgate test CA", "-keyout", ca_key, "-out", ca])
    run(["openssl", "req", *ec, "-subj", "/CN=localhost", "-keyout", key, "-out", csr])
    extensions = folder / "server.ext"
    extensions.write_text(f"subjectAltName={names}\nbasicConstraints=CA:FALSE\n")
    run(["openssl", "x509", "-req", "-in", csr, "-CA", ca, "-CAkey", ca_key, "-CAcreateserial", "-days", "2",
         "-extfile", extensions, "-out", cert])
    return LocalCA(ca, cert, key)


# ---------------------------------------------------------------- a webhook receiver








def plan_nodes(plan: dict[str, Any]) -> list[dict[str, Any]]:
    """Every node of an EXPLAIN (FORMAT JSON) plan, depth first."""
    out = [plan]
    for child in plan.get("Plans", []):
        out += plan_nodes(child)
    return out


# ---------------------------------------------------------------- the whole stack in this process, with its HTTP face


@dataclass
class HttpStack:
    """The four gRPC services and the HTTP service of one test, in this process, with a tenant key and an admin key."""

    settings: Settings
    submit: Any
    notifier: Any
    scheduler: Any
    worker: Any | None
    http: Any
    api_key: str
    admin_key: str

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.http.port}"

    def headers(self, key: str | None = None) -> dict[str, str]:
        return {"authorization": f"Bearer {key or self.api_key}"}


@contextlib.asynccontextmanager
async def http_stack(settings: Settings, backends: Any, *, worker_models: list[str] | None = None) -> Any:
    """Starts submit, notifier, scheduler (and a worker serving `worker_models`, when given) and the HTTP service
    over ephemeral ports; yields an HttpStack and stops everything after."""
    from services.http import service as http_service
    from services.notifier import service as notifier_service
    from services.scheduler import service as scheduler_service
    from services.submit import service as submit_service
    from services.worker import service as worker_service

    submit = await submit_service.start(settings, backends)
    notifier_settings = settings.model_copy(update={"notifier_port": free_port()})
    notifier = await notifier_service.start(notifier_settings)
    scheduler = await scheduler_service.start(settings, backends, scan_loop=False)
    worker = None
    if worker_models is not None:
        worker = await worker_service.start(settings.model_copy(
            update={"worker_models": worker_models, "worker_admin_target": f"127.0.0.1:{scheduler.port}"}
        ))
    http_settings = settings.model_copy(
        update={
            "http_port": 0,
            "http_gateway_target": f"127.0.0.1:{submit.port}",
            "http_events_target": f"127.0.0.1:{notifier.port}",
            "http_admin_target": f"127.0.0.1:{scheduler.port}",
            "worker_admin_target": f"127.0.0.1:{scheduler.port}",
        }
    )
    http = await http_service.start(http_settings)
    api_key, _ = await auth.create_key(
        backends.pool, settings.api_key_pepper, "tenant-a", max_pending=100, submits_per_minute=10_000
    )
    admin_key, _ = await auth.create_key(backends.pool, settings.api_key_pepper, "ops", admin=True)
    stack = HttpStack(http_settings, submit, notifier, scheduler, worker, http, api_key, admin_key)
    try:
        yield stack
    finally:
        # the stack's services as they are now: a test may have replaced one (a notifier restarted on its port); one
        # left running would hold grpc.aio's completion queue, and the process would hang at exit in its shutdown
        await stack.http.stop(0)
        if stack.worker is not None:
            await stack.worker.stop(grace=0)
        await stack.notifier.stop()
        await stack.scheduler.stop(0)
        await stack.submit.stop(0)


async def outcome(call: Awaitable[Any]) -> tuple[grpc.StatusCode, list[Any], Any]:
    """(code, details, response): OK with the response, or the error code with its google.rpc details."""
    try:
        return grpc.StatusCode.OK, [], await call
    except grpc.aio.AioRpcError as exc:
        status = rpc_status.from_call(exc)
        return exc.code(), details_of(status) if status else [], None


def info_of(details: list[Any]) -> error_details_pb2.ErrorInfo:
    """The ErrorInfo among a status's google.rpc details."""
    found = [d for d in details if isinstance(d, error_details_pb2.ErrorInfo)]
    assert found, f"no ErrorInfo in {details}"
    return found[0]


def error_info(exc: grpc.aio.AioRpcError) -> error_details_pb2.ErrorInfo:
    """The ErrorInfo a failed call carried."""
    return info_of(trailing_details(exc))


def with_database(url: str, name: str) -> str:
    parts = urlsplit(url)
    return urlunsplit((parts.scheme, parts.netloc, "/" + name, parts.query, parts.fragment))


def violations(details: list[Any]) -> set[str]:
    bad = next(d for d in details if isinstance(d, error_details_pb2.BadRequest))
    return {v.field for v in bad.field_violations}


def load_example() -> Any:
    """examples/webhook_receiver.py, imported as a module."""
    path = ROOT / "examples" / "webhook_receiver.py"
    spec = importlib.util.spec_from_file_location("webhook_receiver_example", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
