"""A neighbour cannot slow you (#41): one tenant reading GetTask as fast as its limits let it leaves another tenant's
GetTask p99 on the same submit process within twice that tenant's p99 alone.

Two submit replicas run with the default limits. A flooder process (tests.support.flood) holds 64 GetTask calls of the
noisy tenant in flight on one replica; the quiet tenant's GetTask calls go to both replicas in turn, one at a time (A
then B, then B then A, ...), so each of its calls on the flooded replica has a twin on the replica alone, taken the
same moment, on the same machine load (a replica has its own cores in production; here two cores serve everything,
the other engineers' tests included, and their stalls fall on both sides alike). The flood moves from one replica to
the other between blocks, so each process gives as many "alone" samples as "flooded" ones."""

from __future__ import annotations

import asyncio
import os
import statistics
import subprocess
import sys
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import grpc
import pytest

from taskgate import auth
from taskgate.config import Settings
from taskgate.runtime import Backends
from taskgate_api.v1 import gateway_pb2, gateway_pb2_grpc
from taskgate_local.embedded import free_port
from tests.support.harness import ROOT, ServiceProcess, bearer, settings_env

BLOCKS = 4  # the flood on replica 0, 1, 0, 1
PAIRS = 250  # per block: 1,000 samples each side, a p99 of the 10 slowest
SPACING = 0.015  # seconds between pairs: the quiet tenant's ~65 calls/s per replica stay under its own rate
FLOOD_CALLS = 64  # the neighbour's GetTask calls always in flight
DEFAULTS = Settings()  # the replicas' limits: the defaults, as deployed


@pytest.fixture
def replicas(settings: Settings, backends: Backends, tmp_path: Path) -> Iterator[list[ServiceProcess]]:
    """Two submit processes over the test's backends, with the default call limits."""
    with ExitStack() as stack:
        started = []
        for name in ("r0", "r1"):
            env = {k: v for k, v in os.environ.items() if not k.startswith("TASKGATE_")}
            port = free_port()
            own = {
                "submit_port": port,
                "submit_metrics_port": 0,
                # the queue snapshot shared for its production period (the test settings read it on every call)
                "eta_snapshot_seconds": DEFAULTS.eta_snapshot_seconds,
                "tenant_calls_per_second": DEFAULTS.tenant_calls_per_second,
                "tenant_calls_burst": DEFAULTS.tenant_calls_burst,
                "tenant_calls_in_flight": DEFAULTS.tenant_calls_in_flight,
                "process_calls_in_flight": DEFAULTS.process_calls_in_flight,
            }
            env.update(settings_env(settings.model_copy(update=own)))
            service = ServiceProcess(name, "services.submit", env, port, tmp_path / f"{name}.log")
            service.start()
            stack.callback(service.stop)
            started.append(service)
        yield started


def quantile(samples: list[float], q: int) -> float:
    return statistics.quantiles(samples, n=100)[q - 1]


class Flood:
    """tests.support.flood in its own process. Not niced: on a busy machine a niced flooder is starved below its rate
    and floods nothing (its rate is asserted)."""

    def __init__(self, address: str, key: str, task_id: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.support.flood", address, key, task_id, str(FLOOD_CALLS)],
            cwd=ROOT,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self.counted = (0, 0)  # calls served and refused so far, as of its last pause
        self.measured = [0, 0, 0.0]  # served, refused and seconds while measured (from its start to its pause)

    async def tell(self, command: str) -> str:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        return (await asyncio.to_thread(self.proc.stdout.readline)).strip()

    async def start(self) -> None:
        """Floods until past the neighbour's burst: then its calls come at its rate (what the replica lets through)."""
        self._began = asyncio.get_running_loop().time()
        assert await self.tell(f"go {DEFAULTS.tenant_calls_burst + FLOOD_CALLS}") == "flooding"

    async def pause(self, measured: bool = True) -> None:
        word, served, refused = (await self.tell("pause")).split()
        assert word == "paused"
        if measured:
            self.measured[0] += int(served) - self.counted[0]
            self.measured[1] += int(refused) - self.counted[1]
            self.measured[2] += asyncio.get_running_loop().time() - self._began
        self.counted = (int(served), int(refused))

    def end(self) -> None:
        self.proc.communicate("", 60)
        assert self.proc.returncode == 0


async def test_a_tenant_flooding_gettask_leaves_another_tenants_p99_within_twice_its_own_alone(
    backends: Backends, settings: Settings, replicas: list[ServiceProcess]
) -> None:
    for replica in replicas:
        await replica.wait_serving()
    noisy, _ = await auth.create_key(backends.pool, settings.api_key_pepper, "noisy")
    quiet, _ = await auth.create_key(backends.pool, settings.api_key_pepper, "quiet")
    loop = asyncio.get_running_loop()
    async with (
        grpc.aio.insecure_channel(replicas[0].address) as c0,
        grpc.aio.insecure_channel(replicas[1].address) as c1,
    ):
        stubs = [gateway_pb2_grpc.TaskGatewayStub(c0), gateway_pb2_grpc.TaskGatewayStub(c1)]

        async def submitted(key: str) -> str:
            request = gateway_pb2.SubmitTaskRequest(prompt="a quiet lake", model_id="sleepy")
            return str((await stubs[0].SubmitTask(request, metadata=bearer(key))).task.id)

        noisy_task, quiet_task = await submitted(noisy), await submitted(quiet)

        async def took(replica: int) -> float:
            """Seconds one of the quiet tenant's GetTask calls takes on `replica`."""
            start = loop.time()
            await stubs[replica].GetTask(
                gateway_pb2.GetTaskRequest(task_id=quiet_task), metadata=bearer(quiet), timeout=30
            )
            return loop.time() - start

        floods = [Flood(replica.address, noisy, noisy_task) for replica in replicas]
        alone: list[float] = []
        flooded: list[float] = []
        try:
            for flood in floods:  # unmeasured: each replica's first flood (its pool's connections, first reads)
                await flood.start()
                await asyncio.gather(*(took(r) for r in (0, 1, 0, 1)))
                await flood.pause(measured=False)
            for block in range(BLOCKS):
                hit = block % 2
                await floods[hit].start()
                due = loop.time()
                for pair in range(PAIRS):
                    for r in (hit, 1 - hit) if pair % 2 else (1 - hit, hit):
                        (flooded if r == hit else alone).append(await took(r))
                    due += SPACING
                    await asyncio.sleep(max(0.0, due - loop.time()))
                await floods[hit].pause()
        finally:
            for flood in floods:
                await asyncio.to_thread(flood.end)
    quantiles = {q: (quantile(alone, q), quantile(flooded, q)) for q in (50, 90, 99)}
    rates = [served / seconds for served, _, seconds in (flood.measured for flood in floods)]
    figures = "; ".join(f"p{q} {a * 1000:.1f} -> {f * 1000:.1f} ms" for q, (a, f) in quantiles.items())
    figures += (
        f" (alone -> flooded, {len(flooded)} each); the neighbour served {' and '.join(f'{r:.0f}' for r in rates)}"
    )
    figures += f" calls/s, refused {sum(flood.measured[1] for flood in floods)}; load {os.getloadavg()[0]:.1f}"
    print(figures)
    # the neighbour read as fast as its limit lets it while measured (its rate, less its pauses' wind-down)
    assert all(rate > 0.6 * DEFAULTS.tenant_calls_per_second for rate in rates), figures
    assert quantiles[99][1] <= 2 * quantiles[99][0], figures
