"""The benchmark's own stack: embedded servers, the services as processes (several submit processes on one port)."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import asyncpg
import nats
from nats.js import JetStreamContext

from taskgate import auth
from taskgate import bus as busmod
from taskgate.config import ModelSpec, Settings
from taskgate.migrate import migrate
from taskgate.store import bench as bench_store
from taskgate_local.embedded import free_port
from tests.support.harness import Cluster, ServiceProcess

TENANT = "bench"
LONG_MODEL = "sleepy-long"
FLEET_MODEL = "sleepy-fleet"  # the fleet phase's tasks: a 'sleep' of `fleet_seconds`, one step per request step
# the llm phase's chat model (taskgate_local.tinylm), built under the stack's folder by the phase
LLM_MODEL = "llama-tiny"
LLM_SEQUENCES = 16  # sequences the llm phase's one model instance decodes at once


def bench_settings(state_dir: Path, *, fleet_seconds: float = 20.0, **overrides: Any) -> Settings:
    """The shipped defaults, except: a no-op 'sleep' model (a long one for recovery, one of `fleet_seconds` for the
    fleet), the tiny chat model (built by the llm phase), loopback webhooks allowed, metrics endpoints off (several
    processes would fight over their ports)."""
    base: dict[str, Any] = {
        "state_dir": state_dir,
        "models": {
            "sleepy": ModelSpec(kind="sleep", sleep_seconds=0.0),
            LONG_MODEL: ModelSpec(kind="sleep", sleep_seconds=600.0),
            FLEET_MODEL: ModelSpec(kind="sleep", sleep_seconds=fleet_seconds),
            LLM_MODEL: ModelSpec(
                kind="transformers",
                path=state_dir / "models" / LLM_MODEL,
                max_sequences=LLM_SEQUENCES,
                max_input_tokens=4096,
                max_output_tokens=1024,
            ),
        },
        "default_model": "sleepy",
        "callback_allow_hosts": ["127.0.0.1"],
        # one bench tenant is the whole load: its per-process limits are out of the way (the buckets still run)
        "tenant_calls_per_second": 1e9,
        "tenant_calls_in_flight": 0,
        "process_calls_in_flight": 0,
        "max_streams_per_tenant": 1_000_000,
        "max_streams_per_process": 1_000_000,
        "submit_metrics_port": 0,
        "notifier_metrics_port": 0,
        "scheduler_metrics_port": 0,
        "worker_metrics_port": 0,
    }
    return Settings(**{**base, **overrides})


class BenchStack:
    """Owns the cluster; starts and stops groups of processes between phases."""

    def __init__(self, state_dir: Path, submit_procs: int, workers: int, settings: Settings) -> None:
        self.cluster = Cluster(state_dir, settings)
        self.submit_procs = submit_procs
        self.workers = workers
        self.submit_port = free_port()
        self.ceiling_port = free_port()
        self.pool: asyncpg.Pool | None = None
        self.api_key = ""

    @property
    def settings(self) -> Settings:
        return self.cluster.settings

    @property
    def db(self) -> asyncpg.Pool:
        assert self.pool is not None
        return self.pool

    @property
    def submit_address(self) -> str:
        return f"127.0.0.1:{self.submit_port}"

    @property
    def ceiling_address(self) -> str:
        return f"127.0.0.1:{self.ceiling_port}"

    @property
    def notifier_address(self) -> str:
        return self.cluster["notifier"].address

    def submits(self) -> list[str]:
        return [f"submit-{i}" for i in range(1, self.submit_procs + 1)]

    def worker_names(self) -> list[str]:
        return [f"worker-{i}" for i in range(1, self.workers + 1)]

    async def start(self) -> None:
        """Servers, schema, the bench tenant's key (limits lifted), and every process declared; starts the always-on
        ones."""
        await asyncio.to_thread(self.cluster.start_servers)
        assert self.settings.database_url is not None
        self.pool = await asyncpg.create_pool(self.settings.database_url, min_size=1, max_size=4)
        async with self.db.acquire() as conn:
            await migrate(conn)
        self.api_key, _ = await auth.create_key(
            self.db, self.settings.api_key_pepper, TENANT, max_pending=10_000_000, submits_per_minute=100_000_000
        )
        self.declare()
        await self.cluster.start("scheduler", "notifier", *self.submits())

    async def tenant_keys(self, count: int) -> list[str]:
        """Keys of `count` more tenants, limits lifted like the bench tenant's."""
        keys = []
        for i in range(count):
            key, _ = await auth.create_key(
                self.db,
                self.settings.api_key_pepper,
                f"{TENANT}-{i}",
                max_pending=10_000_000,
                submits_per_minute=100_000_000,
            )
            keys.append(key)
        return keys

    def declare(self, **overrides: Any) -> None:
        """(Re)declares every process with the cluster's settings plus `overrides` (e.g. a shorter lease)."""
        c = self.cluster
        c.add("scheduler", "services.scheduler", **overrides)
        c.add("notifier", "services.notifier", **overrides)
        for name in self.submits():
            c.add(name, "services.submit", submit_port=self.submit_port, **overrides)
        for name in self.worker_names():  # not the fleet's model: its consumers would be idle work for these workers
            c.add(name, "services.worker", worker_slots=1, worker_models=["sleepy", LONG_MODEL], **overrides)
        for i in range(1, self.submit_procs + 1):
            ceiling = c.add(f"ceiling-{i}", "bench.ceiling", port_field="submit_port", submit_port=self.ceiling_port)
            ceiling.env["TASKGATE_DB_POOL_SIZE"] = str(self.settings.db_pool_size)

    async def start_workers(self) -> None:
        await self.cluster.start(*self.worker_names())

    async def stop_group(self, names: list[str]) -> None:
        await asyncio.gather(*(asyncio.to_thread(self.cluster[n].stop, 15.0) for n in names))

    def worker_id(self, service: ServiceProcess) -> str:
        """The id a worker process registers under (hostname-pid)."""
        assert service.proc is not None
        return f"{socket.gethostname()}-{service.proc.pid}"

    async def close_open_tasks(self) -> int:
        """Cancels what a phase left unfinished and waits until the notifier has relayed every event."""
        done = await bench_store.close_open(self.db)
        for _ in range(600):
            if not await bench_store.events_unrelayed(self.db):
                break
            await asyncio.sleep(0.1)
        return done

    async def purge_tasks_stream(self) -> None:
        """Drops dispatch messages of cancelled tasks, so workers started later do not chew through them."""
        async with self._jetstream() as js:
            await js.purge_stream(busmod.TASKS_STREAM)

    async def tasks_stream_messages(self) -> int:
        """How many dispatch messages the TASKS stream holds."""
        async with self._jetstream() as js:
            return int((await js.stream_info(busmod.TASKS_STREAM)).state.messages)

    @contextlib.asynccontextmanager
    async def _jetstream(self) -> AsyncIterator[JetStreamContext]:
        """A JetStream context on a connection of its own, closed after use."""
        assert self.settings.nats_url is not None
        nc = await nats.connect(self.settings.nats_url)
        try:
            yield nc.jetstream()
        finally:
            await nc.close()

    async def stop(self) -> None:
        if self.pool is not None:
            await self.pool.close()
        await asyncio.to_thread(self.cluster.stop)
