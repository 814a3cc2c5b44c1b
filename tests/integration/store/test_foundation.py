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
from taskgate_local import protopath
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
            "INSERT INTO task (id, user_id, idempotency_key, request_hash, task_type, model_id, prompt, request_payload,"
            " priority, queue_name) SELECT id + 1, user_id, idempotency_key, request_hash, task_type, model_id, prompt,"
            " request_payload, priority, queue_name FROM task WHERE id=$1",
            task.id,
        )
    queued = await store.queue(pool, task.id, actor="test")
    assert queued.applied


def test_generated_code_is_current(tmp_path: Path) -> None:
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    protos = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "protos/taskgate/v1").glob("*.proto"))
    subprocess.run(
        [sys.executable, "-m", "grpc_tools.protoc", "-Iprotos", f"-I{protopath.include_dir()}", f"--python_out={tmp_path}",
         f"--grpc_python_out={tmp_path}", f"--mypy_out={tmp_path}", f"--mypy_grpc_out={tmp_path}", *protos],
        cwd=ROOT, env=env, check=True, capture_output=True,
    )
    made = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*.py*"))
    assert made, "protoc produced nothing"
    for rel in made:
        assert (ROOT / rel).read_text() == (tmp_path / rel).read_text(), f"{rel} is stale: run `make proto`"


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
