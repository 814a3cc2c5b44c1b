"""One machine as a cluster: three NATS nodes (every stream and the object store at three replicas), two replicas of
submit, notifier and scheduler, three workers. Under load one NATS node is killed and brought back, every service is
rolled (SIGTERM, exit, restart, one replica at a time) and one of each is SIGKILLed; the fault suite's invariants hold
and no client call fails during the rolling restart.

Run with `make test-cluster`. The seed is printed; TASKGATE_CLUSTER_SEED=<seed> replays its choices.
"""

from __future__ import annotations

import asyncio
import os
import random
import time
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import asyncpg
import pytest
from nats.errors import Error as NatsError

from taskgate import auth
from taskgate import bus as busmod
from taskgate.config import ModelSpec, Settings
from taskgate_client import AsyncTaskgateClient, TaskgateError, make_config
from tests.support.chaos import (
    CALLBACK_SHARE,
    TENANT,
    Chaos,
    Fault,
    Submissions,
    check_histories,
    dump_open,
    fault_settings,
    hook_reply,
    print_summary,
    quiescent,
)
from tests.support.harness import Cluster, wait_for
from tests.support.webhooks import WebhookReceiver

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(900)]

NODES = 3
TASKS = int(os.environ.get("TASKGATE_CLUSTER_TASKS", "400"))  # at most; the load stops with the last fault
PACE = 3.0  # tasks submitted per second while the faults happen
SUBMITTERS = 6
ROLES = ("submit", "notifier", "scheduler")
WORKERS = ("worker-1", "worker-2", "worker-3")
QUIESCE_SECONDS = 200.0
STREAMS = (busmod.TASKS_STREAM, busmod.EVENTS_STREAM, busmod.DEAD_STREAM, f"OBJ_{busmod.RESULTS_BUCKET}")


def cluster_settings() -> Settings:
    """The fault suite's short timings, the sleep model only, every stream at three replicas."""
    return fault_settings(Path("unused")).model_copy(
        update={"models": {"sleepy": ModelSpec(kind="sleep", sleep_seconds=0.05)}, "stream_replicas": NODES}
    )


@pytest.fixture
async def cluster(tmp_path: Path) -> AsyncIterator[Cluster]:
    """PostgreSQL, a three-node NATS cluster, and nine service processes declared (not started)."""
    c = Cluster(tmp_path / "cluster", cluster_settings(), nats_nodes=NODES)
    try:
        await asyncio.to_thread(c.start_servers)
        for role in ROLES:
            for i in (1, 2):
                c.add(f"{role}-{i}", f"services.{role}")
        for name in WORKERS:
            worker = c.add(name, "services.worker", worker_slots=1)
            worker.env.update({"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"})
        yield c
    finally:
        await asyncio.to_thread(c.stop)


@dataclass
class Load:
    """Paced submits through the SDK over both submit replicas; every failed call is recorded with the phase it fell
    in."""

    client: AsyncTaskgateClient
    receiver: WebhookReceiver
    rng: random.Random
    subs: Submissions = field(default_factory=Submissions)
    phase: str = "warm-up"
    failed: Counter[tuple[str, str]] = field(default_factory=Counter)  # (phase, status code) -> failed calls
    done: asyncio.Event = field(default_factory=asyncio.Event)
    sent: int = 0

    async def run(self) -> None:
        start = time.monotonic()

        async def submitter() -> None:
            while not self.done.is_set() and self.sent < TASKS:
                i = self.sent
                self.sent += 1
                await asyncio.sleep(max(0.0, start + i / PACE - time.monotonic()))
                await self.one(i)

        await asyncio.gather(*(submitter() for _ in range(SUBMITTERS)))

    async def one(self, i: int) -> None:
        key = f"task-{i}"
        callback = self.rng.random() < CALLBACK_SHARE
        if callback:
            self.subs.with_callback.add(key)
        deadline = time.monotonic() + 120
        while True:
            phase = self.phase
            try:
                handle = await self.client.submit(
                    f"cluster task {i}", "sleepy", steps=2, seed=i, idempotency_key=key, max_retries=3,
                    callback_url=self.receiver.url(f"/hook/{i}") if callback else None,
                )
            except TaskgateError as exc:  # the SDK's own retries are spent: a failed client call
                self.failed[(phase, exc.code_name)] += 1
                self.subs.retries[exc.code_name] += 1
                if time.monotonic() < deadline:
                    continue
                self.subs.given_up[key] = exc.code_name
                return
            self.subs.acked[key] = int(handle.task_id)
            return


async def declared(settings: Settings) -> busmod.Bus:
    """A bus over every node once the cluster has elected its JetStream leader and the replicated streams exist."""
    bus = await busmod.connect(settings.nats_url or "", "cluster-test")
    await busmod.declare(bus, settings)  # retried while the cluster elects its leader
    return bus


async def replicas_current(bus: busmod.Bus) -> bool:
    """Whether every stream has a leader and both followers online and caught up."""
    for name in STREAMS:
        try:
            info = await bus.js.stream_info(name)
        except (NatsError, TimeoutError):
            return False
        peers = info.cluster.replicas if info.cluster is not None else None
        if info.cluster is None or info.cluster.leader is None or peers is None or len(peers) != NODES - 1:
            return False
        if not all(p.current and not p.offline for p in peers):
            return False
    return True


async def test_a_replicated_cluster_survives_a_nats_node_loss_a_rolling_restart_and_kills(
    cluster: Cluster, capsys: pytest.CaptureFixture[str]
) -> None:
    seed = int(os.environ.get("TASKGATE_CLUSTER_SEED") or random.SystemRandom().randrange(2**32))
    with capsys.disabled():
        print(
            f"\ncluster test: seed {seed} (replay: TASKGATE_CLUSTER_SEED={seed} make test-cluster), up to {TASKS} tasks"
        )
    chaos_rng, task_rng, hook_rng = (random.Random(f"{seed}-{part}") for part in ("chaos", "tasks", "hooks"))
    t_start = time.monotonic()
    bus = await declared(cluster.settings)
    db = await asyncpg.create_pool(cluster.settings.database_url, min_size=0, max_size=4)
    assert db is not None
    try:
        await _run(cluster, db, bus, seed, chaos_rng, task_rng, hook_rng, t_start, capsys)
    finally:
        await db.close()
        await bus.close()


async def _run(
    cluster: Cluster, db: asyncpg.Pool, bus: busmod.Bus, seed: int, chaos_rng: random.Random, task_rng: random.Random,
    hook_rng: random.Random, t_start: float, capsys: pytest.CaptureFixture[str],
) -> None:
    await cluster.start()
    assert await replicas_current(bus), "streams not at three current replicas after start-up"
    key, secret = await auth.create_key(
        db, cluster.settings.api_key_pepper, TENANT, max_pending=100_000, submits_per_minute=1_000_000
    )
    assert secret is not None
    setup_s = time.monotonic() - t_start
    submit = "ipv4:" + ",".join(cluster[f"submit-{i}"].address for i in (1, 2))
    notifier = "ipv4:" + ",".join(cluster[f"notifier-{i}"].address for i in (1, 2))
    scheduler = "ipv4:" + ",".join(cluster[f"scheduler-{i}"].address for i in (1, 2))
    config = make_config(submit, key, events_address=notifier, admin_address=scheduler)
    chaos = Chaos(cluster, db, None, (), chaos_rng)  # here only the record of faults and (no) probes
    rolled_exits: dict[str, int] = {}
    async with WebhookReceiver(hook_reply(hook_rng)) as receiver, AsyncTaskgateClient(config) as client:
        load = Load(client, receiver, task_rng)
        t_chaos = time.monotonic()
        submitting = asyncio.create_task(load.run())
        try:
            await wait_for(lambda: len(load.subs.acked) >= 10, 30)
            load.phase = "nats"
            await _nats_node_loss(cluster, db, bus, chaos)
            load.phase = "rolling"
            for name in [f"{role}-{i}" for role in ROLES for i in (1, 2)] + list(WORKERS):
                rolled_exits[name] = await _roll(cluster, name, chaos)
            load.phase = "kills"
            for name in [f"{role}-{chaos_rng.choice((1, 2))}" for role in ROLES] + [chaos_rng.choice(WORKERS)]:
                await _kill(cluster, name, chaos)
            load.phase = "after"
        finally:
            load.done.set()
            await submitting
        chaos_s = time.monotonic() - t_chaos
        t_drain = time.monotonic()
        try:
            await wait_for(lambda: quiescent(db, len(load.subs.acked)), QUIESCE_SECONDS, every=0.5)
        except TimeoutError:
            with capsys.disabled():
                print(f"\nnot quiescent {QUIESCE_SECONDS:g} s after the last fault (seed {seed})")
                await dump_open(db, cluster)
            raise
        drain_s = time.monotonic() - t_drain
        report = await check_histories(db, cluster, load.subs, chaos, receiver, secret)
        if not await replicas_current(bus):
            report["problems"].append("streams not back at three current replicas after the faults")
    rolling = {code: n for (phase, code), n in load.failed.items() if phase == "rolling"}
    if rolling:
        report["problems"].append(f"client calls failed during the rolling restart: {rolling}")
    unclean = {name: code for name, code in rolled_exits.items() if code != 0}
    if unclean:
        report["problems"].append(f"services that did not exit cleanly on SIGTERM: {unclean}")
    with capsys.disabled():
        print_summary(seed, load.subs, chaos, report, setup_s, chaos_s, drain_s, time.monotonic() - t_start)
        print(
            f"  failed client calls by phase: {dict(load.failed)}; SDK retries inside calls: {client.retries}; tasks: "
            f"{load.sent}"
        )
    assert not report["problems"], "\n".join(report["problems"])


async def _nats_node_loss(cluster: Cluster, db: asyncpg.Pool, bus: busmod.Bus, chaos: Chaos) -> None:
    """SIGKILLs one NATS node, starts it again on the same port and store, and waits until its replicas caught up."""
    index = chaos.rng.randrange(NODES)
    node = cluster.nats_nodes[index]
    fault = Fault(f"nats-{index + 1}", time.monotonic() - chaos.started, measure="every stream's replicas current")
    chaos.faults.append(fault)
    before = await db.fetchval("SELECT now()")
    t0 = time.monotonic()
    await asyncio.to_thread(node.kill)
    await asyncio.sleep(chaos.rng.uniform(1.0, 3.0))
    await asyncio.to_thread(node.start)
    fault.down_s = fault.restart_s = time.monotonic() - t0
    await wait_for(lambda: replicas_current(bus), 60, every=0.5)
    fault.recovery_s = time.monotonic() - t0
    fault.window = (before, await db.fetchval("SELECT now()"))


async def _roll(cluster: Cluster, name: str, chaos: Chaos) -> int:
    """SIGTERM, wait for the exit, start again, wait until it serves; returns the exit code."""
    fault = Fault(f"{name} TERM", time.monotonic() - chaos.started, measure="health check")
    chaos.faults.append(fault)
    service = cluster[name]
    t0 = time.monotonic()
    await asyncio.to_thread(service.stop, 30.0)  # SIGKILL only past 30 s: that exit code is reported
    fault.down_s = time.monotonic() - t0
    fault.restart_s = await cluster.restart(name) + fault.down_s
    fault.recovery_s = time.monotonic() - t0
    return service.exits[-1]


async def _kill(cluster: Cluster, name: str, chaos: Chaos) -> None:
    """SIGKILL, a short pause, start again, wait until it serves."""
    fault = Fault(f"{name} KILL", time.monotonic() - chaos.started, measure="health check")
    chaos.faults.append(fault)
    t0 = time.monotonic()
    cluster.kill(name)
    await asyncio.sleep(chaos.rng.uniform(0.2, 1.0))
    fault.down_s = time.monotonic() - t0
    fault.restart_s = await cluster.restart(name) + fault.down_s
    fault.recovery_s = time.monotonic() - t0
