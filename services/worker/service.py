"""The worker service: loads its models, starts the engine and the WorkerControl server, drains on SIGTERM."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import socket
from collections.abc import Iterable
from dataclasses import dataclass

import grpc

from services.worker import runner as runmod
from services.worker.control import Operators, WorkerControlServicer
from services.worker.engine import TestSignals, Worker
from taskgate.config import WorkerSettings
from taskgate.runtime import Backends, connect, stop_signal
from taskgate.server import Health, Probes, mark_not_serving, start_server
from taskgate_api.v1 import worker_pb2_grpc

log = logging.getLogger("taskgate.worker")

SERVICE_NAME = "taskgate.v1.WorkerControl"
_instances = itertools.count()


@dataclass
class WorkerHandle:
    """A running worker: its control port and id, a graceful stop (drain) and a crash (kill) for tests."""

    port: int
    worker: Worker
    server: grpc.aio.Server
    health: Health
    backends: Backends
    owns_backends: bool
    operators: Operators
    stopped: bool = False

    @property
    def worker_id(self) -> str:
        """The id this worker claims under and registers as."""
        return self.worker.worker_id

    async def stop(self, grace: float | None = None) -> None:
        """Drains (running tasks get `grace`, default drain_grace_seconds, then are released) and closes."""
        if self.stopped:
            return
        self.stopped = True
        try:
            await mark_not_serving(self.health)
            await self.worker.begin_drain(grace)
            await self.worker.close()
            await self.server.stop(1.0)
        finally:
            await self.operators.close()
            if self.owns_backends:
                await self.backends.close()

    async def kill(self) -> None:
        """Simulates a crash: heartbeats and runs stop, nothing is released or acked, connections close."""
        self.stopped = True
        await self.server.stop(0)
        await self.health.stop_checking()
        await self.operators.close()
        await self.worker.kill()
        if self.owns_backends:
            with contextlib.suppress(Exception):
                await self.backends.bus.nc.close()
            self.backends.pool.terminate()


def default_worker_id() -> str:
    """hostname-pid, with a counter for a second worker in the same process (tests)."""
    n = next(_instances)
    base = f"{socket.gethostname()}-{os.getpid()}"
    return base if n == 0 else f"{base}-{n}"


def served_models(settings: WorkerSettings) -> list[str]:
    """The models this worker serves: worker_models, or every registered model."""
    wanted = settings.worker_models or list(settings.models)
    unknown = [m for m in wanted if m not in settings.models]
    if unknown:
        raise ValueError(f"worker_models names unknown models: {unknown}")
    return wanted


def advertised_host(settings: WorkerSettings) -> str:
    """The host other services reach this worker's WorkerControl at: worker_advertise_host (a pod's IP), else the bind
    address, else (bound to every address) the host name."""
    if settings.worker_advertise_host:
        return settings.worker_advertise_host
    if settings.grpc_host not in ("0.0.0.0", "::", ""):
        return settings.grpc_host
    return socket.gethostname()


async def start(
    settings: WorkerSettings, backends: Backends | None = None, *, signals: TestSignals | None = None
) -> WorkerHandle:
    """Loads the models, then starts consuming and serves WorkerControl on settings.worker_port (0 = ephemeral);
    `signals`: a test's armed TestSignals."""
    models = served_models(settings)
    specs = {m: settings.models[m] for m in models}
    plan = await asyncio.to_thread(
        runmod.device_plan, {s.kind for s in specs.values()}, settings.worker_slots, settings.worker_slots_per_device
    )
    runners = await asyncio.to_thread(runmod.load_runners, specs, plan.devices)
    plan = runmod.with_sequences(plan, runners)
    owns = backends is None
    if backends is None:
        backends = await connect(settings, "worker")
    try:
        worker = Worker(settings, backends, runners, plan, settings.worker_id or default_worker_id(), models, signals)
        await worker.start()
        operators = Operators(settings)
        servicer = WorkerControlServicer(worker, operators)

        def register(server: grpc.aio.Server) -> Iterable[str]:
            worker_pb2_grpc.add_WorkerControlServicer_to_server(servicer, server)
            return [SERVICE_NAME]

        probes = Probes(pool=backends.pool, bus=backends.bus, draining=lambda: worker.draining, loops=worker.loops)
        server, port, health_servicer = await start_server(settings, settings.worker_port, register, probes)
        worker.control_address = f"{advertised_host(settings)}:{port}"
    except BaseException:
        if owns:
            await backends.close()
        raise
    return WorkerHandle(port, worker, server, health_servicer, backends, owns, operators)


async def main(settings: WorkerSettings) -> None:
    """Runs a worker until SIGTERM/SIGINT, then drains and exits. A Drain call is a cordon, not a stop: the worker
    takes no more work and is not ready, but stays up (alive, answering) until it is told to stop."""
    async with stop_signal() as stop:
        handle = await start(settings)
        await stop.wait()
        log.info("stopping", extra={"worker": handle.worker_id, "grace_seconds": settings.drain_grace_seconds})
        await handle.stop()
