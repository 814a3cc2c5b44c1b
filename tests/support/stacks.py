"""The services of one test started together, with what a test needs to drive them: the SDK's stack, the CLI's,
TaskAdmin's."""

from __future__ import annotations

import asyncio
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from services.notifier import service as notifier_service
from services.scheduler import service as scheduler_service
from services.submit import service as submit_service
from taskgate import auth, store
from taskgate.config import Settings
from taskgate.results import result_store
from taskgate.runtime import Backends
from taskgate_api.v1 import admin_pb2_grpc
from taskgate_client import (
    AsyncTaskgateClient,
    connect_async,
)
from tests.support.factories import Metadata, claimed

SMALL = {"frames": 9, "width": 32, "height": 32, "steps": 2}



@dataclass
class Stack:
    """The public services of one test, plus keys."""

    settings: Settings
    backends: Backends
    submit: submit_service.SubmitHandle
    scheduler: scheduler_service.SchedulerHandle
    notifier: notifier_service.NotifierHandle
    api_key: str
    admin_key: str

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.submit.port}"

    @property
    def events_address(self) -> str:
        return f"127.0.0.1:{self.notifier.port}"

    @property
    def admin_address(self) -> str:
        return f"127.0.0.1:{self.scheduler.port}"

    def client(self, **overrides: object) -> AsyncTaskgateClient:
        options: dict[str, object] = {
            "events_address": self.events_address,
            "admin_address": self.admin_address,
            "admin_key": self.admin_key,
        }
        options.update(overrides)
        address = str(options.pop("address", self.address))
        api_key = options.pop("api_key", self.api_key)
        return connect_async(address, api_key, **options)  # type: ignore[arg-type]

    async def key(self, tenant: str, **limits: int) -> str:
        key, _ = await auth.create_key(self.backends.pool, self.settings.api_key_pepper, tenant, **limits)  # type: ignore[arg-type]
        return key


async def run_task(
    backends: Backends, task_id: str, result: bytes | None = b"video-bytes", *, progress: tuple[int, ...] = (50,)
) -> None:
    """Plays the worker: claim, report progress, then succeed with `result` (or fail when it is None)."""
    tid = int(task_id)
    attempt = (await claimed(backends.pool, tid, worker_id="test-worker")).attempt
    for pct in progress:
        out = await store.progress(backends.pool, tid, attempt=attempt, percent=pct, lease_seconds=30.0, actor="worker")
        assert out.task is not None
    if result is None:
        error = store.TaskError("BOOM", "it broke")
        out = await store.fail(backends.pool, tid, error=error, actor="worker", reason="failed", attempt=attempt)
    else:
        stored = await result_store(backends.settings, backends.bus).put(
            f"{task_id}-a{attempt}.mp4", result, "video/mp4"
        )
        result_ref = store.ResultRef(stored.uri, stored.content_type, stored.size, stored.sha256)
        out = await store.succeed(backends.pool, tid, attempt=attempt, result=result_ref, actor="worker")
    assert out.task is not None


async def run_task_finish(backends: Backends, task_id: str, attempt: int) -> None:
    stored = await result_store(backends.settings, backends.bus).put(f"{task_id}-a{attempt}.mp4", b"data", "video/mp4")
    result = store.ResultRef(stored.uri, stored.content_type, stored.size, stored.sha256)
    out = await store.succeed(backends.pool, int(task_id), attempt=attempt, result=result, actor="worker")
    assert out.task is not None


@dataclass
class Result:
    """One finished CLI run."""

    code: int
    out: str
    err: str

    def json(self) -> Any:
        return json.loads(self.out)

    def lines(self) -> list[Any]:
        return [json.loads(line) for line in self.out.splitlines() if line.strip()]


@dataclass
class Cli:
    """Runs `python -m taskgate_client.cli` with the stack's addresses in the environment (not the flags)."""

    env: dict[str, str]
    cwd: Path
    settings: Settings
    backends: Backends

    async def __call__(self, *args: str, env: dict[str, str] | None = None, cwd: Path | None = None) -> Result:
        return await self.run("taskgate_client.cli", args, env=env, cwd=cwd)

    async def keys(self, *args: str) -> Result:
        """Runs the server-side `taskgate-keys` (`python -m taskgate.keys`) in the same environment."""
        return await self.run("taskgate.keys", args)

    async def run(
        self, module: str, args: tuple[str, ...], *, env: dict[str, str] | None = None, cwd: Path | None = None
    ) -> Result:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", module, *args,
            env={**self.env, **(env or {})},
            cwd=cwd or self.cwd,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        out, err = await asyncio.wait_for(proc.communicate(), 60)
        assert proc.returncode is not None
        return Result(proc.returncode, out.decode(), err.decode())

    async def key(self, tenant: str, **limits: Any) -> str:
        key, _ = await auth.create_key(self.backends.pool, self.settings.api_key_pepper, tenant, **limits)
        return key


@dataclass
class Admin:
    """A running scheduler (scan loop off), a TaskAdmin stub, and call metadata for an admin and a tenant key."""

    backends: Backends
    stub: admin_pb2_grpc.TaskAdminAsyncStub
    admin: Metadata
    user: Metadata
