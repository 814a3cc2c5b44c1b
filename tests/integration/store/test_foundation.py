"""Foundation rules: migrations re-run safely, the schema keeps illegal rows out, generated code is current,
and a bad setting stops a service with one clear line."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import asyncpg
import pytest

from taskgate import store
from taskgate.migrate import migrate
from taskgate.runtime import Backends
from taskgate_local import protogen
from tests.support.factories import insert_task
from tests.support.harness import ROOT


async def test_migrations_rerun_as_no_ops(backends: Backends) -> None:
    async with backends.pool.acquire() as conn:
        assert await migrate(conn) == []
        versions = [r["version"] for r in await conn.fetch("SELECT version FROM schema_migration ORDER BY version")]
    assert versions == sorted(versions) and versions[0] == 1


async def test_schema_refuses_rows_that_break_the_rules(backends: Backends) -> None:
    task = await insert_task(backends.pool)
    pool = backends.pool
    with pytest.raises(asyncpg.CheckViolationError):  # a terminal state needs finished_at
        await pool.execute("UPDATE task SET status='CANCELED', version=version+1 WHERE id=$1", task.id)
    with pytest.raises(asyncpg.CheckViolationError):  # PROCESSING needs a worker and a lease
        await pool.execute("UPDATE task SET status='PROCESSING', version=version+1 WHERE id=$1", task.id)
    with pytest.raises(asyncpg.RaiseError):  # versions grow by exactly one
        await pool.execute("UPDATE task SET version=version+2 WHERE id=$1", task.id)
    with pytest.raises(asyncpg.CheckViolationError):
        await pool.execute("UPDATE task SET progress=101 WHERE id=$1", task.id)
    with pytest.raises(asyncpg.UniqueViolationError):  # one idempotency key per tenant
        await pool.execute(
            "INSERT INTO task (id, user_id, idempotency_key, request_hash, task_type, model_id, prompt, "
            "request_payload, priority, queue_name) SELECT id + 1, user_id, idempotency_key, request_hash, task_type, "
            "model_id, prompt, request_payload, priority, queue_name FROM task WHERE id=$1",
            task.id,
        )
    queued = await store.queue(pool, task.id, actor="test")
    assert queued.applied


def test_generated_code_is_current(tmp_path: Path) -> None:
    made = protogen.generate(tmp_path)
    assert made, "protoc produced nothing"
    committed = sorted(p.name for pattern in protogen.GENERATED for p in protogen.TARGET.glob(pattern))
    assert committed == sorted(p.name for p in made), "generated modules differ from protos/: run `make proto`"
    for path in made:
        assert (protogen.TARGET / path.name).read_text() == path.read_text(), f"{path.name} is stale: run `make proto`"


def test_the_generated_modules_live_in_taskgate_api_and_keep_the_wire_names() -> None:
    from taskgate_api.v1 import admin_pb2, gateway_pb2_grpc, task_pb2

    assert task_pb2.Task.__module__ == "taskgate_api.v1.task_pb2"  # pickling and reprs find the class where it is
    assert task_pb2.DESCRIPTOR.name == "taskgate/v1/task.proto" and task_pb2.DESCRIPTOR.package == "taskgate.v1"
    assert admin_pb2.DESCRIPTOR.services_by_name["TaskAdmin"].full_name == "taskgate.v1.TaskAdmin"
    assert gateway_pb2_grpc.TaskGatewayStub.__module__ == "taskgate_api.v1.gateway_pb2_grpc"
    assert "taskgate.v1" not in sys.modules, "a generated module imported the old package"


@pytest.mark.parametrize(
    ("variable", "value"),
    [("TASKGATE_SUBMIT_PORT", "not-a-port"), ("TASKGATE_LEASE_SECONDS", "-1"), ("TASKGATE_LOG_LEVEL", "LOUD")],
)
def test_a_bad_setting_stops_with_one_line_naming_it(variable: str, value: str) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TASKGATE_")}
    env[variable] = value
    proc = subprocess.run(
        [sys.executable, "-m", "services.submit"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and variable in lines[0], proc.stderr
