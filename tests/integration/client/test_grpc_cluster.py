"""gRPC in a cluster: keepalive pings accepted, connections aged out, the SDK balancing over every replica."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.submit.service import start as start_submit
from taskgate.config import Settings
from taskgate.runtime import Backends
from taskgate_client import AsyncTaskgateClient, ClientConfig
from taskgate_client.config import channel_target, sibling_address
from tests.support import factories
from tests.support.harness import Cluster, wait_for


def test_sdk_addresses_for_lists_headless_names_and_the_shipped_services() -> None:
    assert channel_target("taskgate-submit:50051") == "dns:///taskgate-submit:50051"
    assert channel_target("ipv4:127.0.0.1:1,127.0.0.1:2") == "ipv4:127.0.0.1:1,127.0.0.1:2"
    assert channel_target("dns:///gw:1") == "dns:///gw:1" and channel_target("unix:/tmp/s") == "unix:/tmp/s"
    assert sibling_address("ipv4:127.0.0.1:1,127.0.0.1:2", 50052) == "ipv4:127.0.0.1:50052,127.0.0.1:50052"
    assert sibling_address("ipv6:[::1]:1,[::2]:1", 50053) == "ipv6:[::1]:50053,[::2]:50053"
    assert sibling_address("taskgate-submit:50051", 50052) == "taskgate-notifier:50052"
    assert sibling_address("dns:///taskgate-submit.prod.svc.cluster.local:50051", 50053) == (
        "dns:///taskgate-scheduler.prod.svc.cluster.local:50053"
    )
    assert sibling_address("taskgate-submitter:50051", 50052) == "taskgate-submitter:50052"


async def _idle_channel_survives(settings: Settings, backends: Backends) -> bool:
    """Whether a channel pinging without calls (about once a second: gRPC throttles a 200 ms keepalive) stays connected
    for 5 s; gRPC's server answers the third ping it finds too early with GOAWAY too_many_pings."""
    handle = await start_submit(settings, backends)
    try:
        options = [
            ("grpc.keepalive_time_ms", 200),
            ("grpc.keepalive_timeout_ms", 5000),
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.http2.max_pings_without_data", 0),
        ]
        async with grpc.aio.insecure_channel(f"127.0.0.1:{handle.port}", options=options) as channel:
            await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
            with contextlib.suppress(TimeoutError):
                await wait_for(lambda: channel.get_state() is not grpc.ChannelConnectivity.READY, within=5, every=0.1)
            return channel.get_state() is grpc.ChannelConnectivity.READY
    finally:
        await handle.stop(0)


async def test_keepalive_pings_on_an_idle_connection_are_accepted(settings: Settings, backends: Backends) -> None:
    assert await _idle_channel_survives(settings.model_copy(update={"grpc_min_ping_interval_seconds": 0.1}), backends)
    # the control: gRPC's policy without that setting (5 min) closes the connection
    assert not await _idle_channel_survives(
        settings.model_copy(update={"grpc_min_ping_interval_seconds": 300}), backends
    )


@pytest.mark.slow
async def test_three_replicas_share_load_lose_none_to_a_kill_and_reach_a_replica_added_later(
    settings: Settings, backends: Backends, tmp_path: Path
) -> None:
    metadata = await factories.key_for(backends, max_pending=1_000_000, submits_per_minute=1_000_000)
    aged = settings.model_copy(
        update={"grpc_max_connection_age_seconds": 1.0, "grpc_max_connection_age_grace_seconds": 1.0}
    )
    cluster = Cluster(tmp_path, aged)
    replicas = [cluster.add(f"submit-{i}", "services.submit") for i in range(3)]
    target = "ipv4:" + ",".join(r.address for r in replicas)
    made: list[str] = []
    failures: list[BaseException] = []
    try:
        await cluster.start()

        async def node_of(pid: int) -> int | None:
            """The node number a replica process leased: which replica made a task id."""
            return await backends.pool.fetchval(
                "SELECT node FROM id_node_lease WHERE split_part(holder, ':', 2) = $1", str(pid)
            )

        node = [await node_of(r.proc.pid) for r in replicas if r.proc is not None]
        assert None not in node and len(set(node)) == 3

        def served(n: int | None) -> int:
            return sum(1 for t in made if (int(t) >> 12) & 1023 == n)

        config = ClientConfig(
            address=target, api_key=metadata[0][1].removeprefix("Bearer "), retry_attempts=10, retry_max_delay=0.5
        )
        async with AsyncTaskgateClient(config) as client:
            stop = asyncio.Event()

            async def load(worker: int) -> None:
                n = 0
                while not stop.is_set():
                    try:
                        task = await client.submit("p", "sleepy", idempotency_key=f"w{worker}-{n}")
                    except Exception as exc:  # a failed call is the failure under test
                        failures.append(exc)
                        return
                    made.append(task.task_id)
                    n += 1

            loops = [asyncio.create_task(load(w)) for w in range(6)]
            try:
                await wait_for(lambda: len(made) >= 90 or bool(failures), within=120)
                assert not failures, failures
                shares = [served(n) / len(made) for n in node]
                assert min(shares) > 0.2, shares  # round_robin: about a third each

                before = len(made)
                replicas[1].kill()  # SIGKILL with calls in flight
                await wait_for(lambda: len(made) >= before + 60 or bool(failures), within=120)

                late = cluster.add("submit-late", "services.submit", submit_port=replicas[0].port)  # SO_REUSEPORT
                late.start()
                assert late.proc is not None
                pid = late.proc.pid
                async def leased() -> bool:
                    return await node_of(pid) is not None

                await wait_for(leased, within=120)  # taken before it serves; traffic tells when it does
                late_node = await node_of(pid)
                # its port's existing connection stays with replica 0 until its age ends; a new one may land here
                await wait_for(lambda: served(late_node) > 0 or bool(failures), within=120)
            finally:
                stop.set()
                await asyncio.gather(*loops)
    finally:
        cluster.stop()
    assert not failures, failures
    rows = await backends.pool.fetch("SELECT id FROM task WHERE idempotency_key LIKE 'w%'")
    assert {str(r["id"]) for r in rows} >= set(made) and len(set(made)) == len(made)
