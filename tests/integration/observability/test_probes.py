"""Health probes that mean something, against real services: readiness follows PostgreSQL, NATS and draining; liveness
only the process and its loops; a drained worker stays up, alive and answering but not ready, until it is told to stop;
a service started before its database retries with a log line per attempt and then serves."""

from __future__ import annotations

import asyncio
import json
import signal
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.scheduler import service as scheduler_service
from taskgate import auth
from taskgate.config import ModelSpec, Settings
from taskgate.runtime import Backends
from taskgate.server import LIVENESS, READINESS, Probes, start_server
from taskgate_api.v1 import worker_pb2, worker_pb2_grpc
from tests.support.factories import all_settings
from tests.support.harness import ROOT, Cluster, settings_env, wait_for

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


async def health(address: str, service: str) -> int:
    async with grpc.aio.insecure_channel(address) as channel:
        reply = await health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=service), timeout=5
        )
    return int(reply.status)


async def probes(address: str) -> tuple[int, int]:
    """(liveness, readiness)."""
    return await health(address, LIVENESS), await health(address, READINESS)


def quick(settings: Settings) -> Settings:
    return settings.model_copy(update={"health_check_seconds": 0.1, "health_check_timeout_seconds": 0.5})


@pytest.fixture
async def cluster(settings: Settings, tmp_path: Path) -> AsyncIterator[Cluster]:
    """PostgreSQL and NATS of this test's own, so it may stop them."""
    c = Cluster(tmp_path / "cluster", quick(settings))
    await asyncio.to_thread(c.start_servers)
    try:
        yield c
    finally:
        await asyncio.to_thread(c.stop)


async def test_readiness_follows_nats_and_postgres_while_liveness_stays(cluster: Cluster) -> None:
    handle = await scheduler_service.start(cluster.settings)
    address = f"127.0.0.1:{handle.port}"
    try:
        assert await probes(address) == (SERVING, SERVING)
        assert await health(address, "taskgate.v1.TaskAdmin") == SERVING

        await asyncio.to_thread(cluster.kill_nats)
        await wait_for(lambda: _is(address, READINESS, NOT_SERVING), 10)
        assert await probes(address) == (SERVING, NOT_SERVING), "NATS down: out of the Service, not restarted"
        assert await health(address, "taskgate.v1.TaskAdmin") == NOT_SERVING  # each API's name follows readiness
        await asyncio.to_thread(cluster.start_nats)
        await wait_for(lambda: _is(address, READINESS, SERVING), 30)

        await asyncio.to_thread(cluster.kill_postgres)
        await wait_for(lambda: _is(address, READINESS, NOT_SERVING), 10)
        assert await health(address, LIVENESS) == SERVING, "PostgreSQL down: out of the Service, not restarted"
        await asyncio.to_thread(cluster.start_postgres)
        await wait_for(lambda: _is(address, READINESS, SERVING), 30)
    finally:
        await handle.stop()


async def _is(address: str, service: str, status: int) -> bool:
    return await health(address, service) == status


async def test_liveness_fails_when_a_loop_the_process_needs_has_ended(settings: Settings) -> None:
    ended = asyncio.create_task(asyncio.sleep(0))
    await ended
    server, port, probe = await start_server(quick(settings), 0, lambda _: [], Probes(loops=lambda: [ended]))
    try:
        assert await probes(f"127.0.0.1:{port}") == (NOT_SERVING, NOT_SERVING)
    finally:
        await probe.shutdown()
        await server.stop(0)


async def test_a_drained_worker_stays_up_alive_and_answering_but_not_ready(
    settings: Settings, backends: Backends, tmp_path: Path
) -> None:
    # vouches for WorkerControl callers
    admin = await scheduler_service.start(all_settings(backends), backends, scan_loop=False)
    key, _ = await auth.create_key(backends.pool, settings.api_key_pepper, "ops", admin=True)
    operator = (("authorization", f"Bearer {key}"),)
    s = quick(settings).model_copy(
        update={
            "worker_admin_target": f"127.0.0.1:{admin.port}",
            "models": {"sleepy": ModelSpec(kind="sleep", sleep_seconds=0.1)},
            "default_model": "sleepy",
            "worker_models": ["sleepy"],
            "worker_id": "cordoned",
            "worker_port": 0,
            "drain_grace_seconds": 0.2,
            "heartbeat_seconds": 0.2,
            "state_dir": tmp_path,
        }
    )
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "services.worker", env=settings_env(s) | {"PYTHONUNBUFFERED": "1"}, cwd=ROOT,
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE)
    assert proc.stderr is not None
    try:
        address = ""
        while not address:  # the worker logs its bound port when its server starts
            line = json.loads(await asyncio.wait_for(proc.stderr.readline(), 60) or b'{"msg": "exited"}')
            assert line["msg"] != "exited", "the worker exited before serving"
            if line["msg"] == "grpc server started":
                address = "127.0.0.1:" + line["address"].rsplit(":", 1)[1]
        drained_logs = asyncio.create_task(proc.stderr.read())
        assert await probes(address) == (SERVING, SERVING)

        async with grpc.aio.insecure_channel(address) as channel:
            control = worker_pb2_grpc.WorkerControlStub(channel)
            assert (await control.Drain(worker_pb2.DrainRequest(), metadata=operator, timeout=5)).draining
            await wait_for(lambda: _is(address, READINESS, NOT_SERVING), 10)
            assert await health(address, "taskgate.v1.WorkerControl") == NOT_SERVING
            for _ in range(5):  # well past the drain's grace and several health checks: still up, alive, answering
                assert await health(address, LIVENESS) == SERVING
                status = await control.GetStatus(worker_pb2.GetStatusRequest(), metadata=operator, timeout=5)
                assert status.draining and not status.running
                assert proc.returncode is None, "a drain is a cordon, not a stop"
                await asyncio.sleep(0.2)

        proc.send_signal(signal.SIGTERM)  # told to stop: it exits cleanly
        assert await asyncio.wait_for(proc.wait(), 30) == 0, (await drained_logs).decode()[-2000:]
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        await admin.stop(0)


async def test_startup_retries_the_database_with_a_log_line_per_attempt(cluster: Cluster) -> None:
    await asyncio.to_thread(cluster.kill_postgres)
    service = cluster.add("scheduler", "services.scheduler")
    service.start()
    try:
        def attempts() -> list[dict[str, object]]:
            lines = [json.loads(line) for line in service.log_path.read_text().splitlines() if line.startswith("{")]
            return [line for line in lines if line["msg"] == "PostgreSQL not reachable yet; retrying"]

        await wait_for(lambda: len(attempts()) >= 2 or not service.alive, 30)
        assert service.alive, service.tail()
        assert [a["attempt"] for a in attempts()[:2]] == [1, 2]
        await asyncio.to_thread(cluster.start_postgres)
        await service.wait_serving(60)
        assert await probes(service.address) == (SERVING, SERVING)
    finally:
        service.stop()
