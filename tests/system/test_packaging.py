"""The distributions, built from this checkout and installed where users put them: each side in a clean virtual
environment with the API distribution both depend on, run from outside the checkout. The client's has no torch and no
server code and drives a running stack with the CLI and the SDK; the server's (non-editable, without the client)
migrates an empty database and serves."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import asyncpg
import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from taskgate import sql
from taskgate.config import Settings
from taskgate_local import wheelhouse
from taskgate_local.embedded import free_port
from tests.support.harness import ROOT, settings_env, wait_for, with_database
from tests.support.stacks import Cli

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

SKIP = shutil.ignore_patterns(
    ".venv", ".git", ".taskgate", "__pycache__", "build", "*.egg-info", "tests", "bench", "deploy"
)
SDK_SCRIPT = """
import json, sys
from taskgate_client import connect
with connect() as client:
    task = client.submit("a fox", "sleepy", steps=2)
    events = [e.status.value for e in client.watch(task.task_id)]
    info = client.download(task.task_id, sys.argv[1])
    print(json.dumps({"events": events, "size": info.size_bytes}))
"""


def _run(args: list[str], *, env: dict[str, str] | None = None, cwd: Path, timeout: float = 600) -> str:
    out = subprocess.run(args, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout, check=False)
    assert out.returncode == 0, f"{' '.join(args)}:\n{out.stdout}\n{out.stderr}"
    return out.stdout


@pytest.fixture(scope="module")
def wheels(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The three wheels, built from a copy of the checkout (no build folders left in it)."""
    base = tmp_path_factory.mktemp("wheels")
    source = base / "src"
    shutil.copytree(ROOT, source, ignore=SKIP)
    pip = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(base / "dist")]
    _run([*pip, "./clients/api", "./clients/python", "."], cwd=source)
    built = {p.name.split("-")[0]: p for p in (base / "dist").glob("*.whl")}
    assert set(built) == {"taskgate", "taskgate_client", "taskgate_api"}
    return built


def _importable(python: str, module: str, cwd: Path, env: dict[str, str] | None = None) -> bool:
    return (
        subprocess.run(
            [python, "-c", f"import {module}"], cwd=cwd, env=env, capture_output=True, check=False
        ).returncode
        == 0
    )


def _venv(python: str, where: Path, *wheel_files: Path) -> Path:
    """A clean virtual environment holding `wheel_files` and their dependencies at the versions of constraints.txt, all
    from the wheelhouse `make venv` filled: no package index is asked."""
    if not wheelhouse.complete_marker().exists():
        pytest.skip(
            f"no wheelhouse at {wheelhouse.location()}: `make venv` fills it (once, with the package index reachable)"
        )
    _run([python, "-m", "venv", str(where)], cwd=where.parent)
    _run(
        [
            str(where / "bin" / "python"),
            "-m",
            "pip",
            "install",
            "-q",
            "--no-index",
            "--find-links",
            str(wheelhouse.location()),
            "-c",
            str(ROOT / "constraints.txt"),
            *map(str, wheel_files),
        ],
        cwd=where.parent,
    )
    return where / "bin"


def _clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TASKGATE_", "PYTHON", "VIRTUAL_ENV"))}
    return env | extra


async def test_client_wheel_alone_drives_a_stack_without_torch(
    wheels: dict[str, Path], cli: Cli, tmp_path: Path
) -> None:
    bin_dir = await asyncio.to_thread(
        _venv,
        wheelhouse.python_for_client(),
        tmp_path / "client-venv",
        wheels["taskgate_api"],
        wheels["taskgate_client"],
    )
    python = str(bin_dir / "python")
    env = _clean_env(
        **{k: v for k, v in cli.env.items() if k.startswith("TASKGATE_") and "DATABASE" not in k and "NATS" not in k}
    )
    for absent in ("torch", "diffusers", "asyncpg", "taskgate", "services"):
        assert not await asyncio.to_thread(_importable, python, absent, tmp_path, env), (
            f"{absent} is in the client's environment"
        )

    sdk = await asyncio.to_thread(_run, [python, "-c", SDK_SCRIPT, str(tmp_path / "sdk.bin")], env=env, cwd=tmp_path)
    seen = json.loads(sdk)
    assert seen["events"][-1] == "SUCCEEDED" and seen["size"] == (tmp_path / "sdk.bin").stat().st_size

    taskgate = str(bin_dir / "taskgate")
    submitted = json.loads(
        await asyncio.to_thread(
            _run,
            [taskgate, "submit", "a cat", "--model", "sleepy", "--steps", "2", "--wait", "--json"],
            env=env,
            cwd=tmp_path,
        )
    )
    assert submitted["status"] == "SUCCEEDED", submitted
    await asyncio.to_thread(
        _run, [taskgate, "result", submitted["task_id"], "-o", str(tmp_path / "cli.bin")], env=env, cwd=tmp_path
    )
    assert (tmp_path / "cli.bin").stat().st_size > 0
    stats = await asyncio.to_thread(_run, [taskgate, "--json", "admin", "stats"], env=env, cwd=tmp_path)
    assert json.loads(stats)


async def test_server_wheel_migrates_and_serves(wheels: dict[str, Path], servers: tuple[str, str], settings: Settings,
                                                tmp_path: Path) -> None:
    bin_dir = await asyncio.to_thread(
        _venv, sys.executable, tmp_path / "server-venv", wheels["taskgate_api"], wheels["taskgate"]
    )
    python = str(bin_dir / "python")
    assert not await asyncio.to_thread(_importable, python, "torch", tmp_path), "torch belongs to the worker extra"
    assert not await asyncio.to_thread(_importable, python, "taskgate_client", tmp_path), (
        "the server runs without the client"
    )

    admin = await asyncpg.connect(servers[0])
    name = f"wheel_{os.getpid()}"
    try:
        await admin.execute(f"DROP DATABASE IF EXISTS {name}")
        await admin.execute(f"CREATE DATABASE {name}")
        database_url = with_database(servers[0], name)
        port = free_port()
        env = _clean_env(
            **settings_env(settings.model_copy(update={"database_url": database_url, "submit_port": port}))
        )
        await asyncio.to_thread(_run, [python, "-m", "taskgate.migrate"], env=env, cwd=tmp_path)
        conn = await asyncpg.connect(database_url)
        try:
            applied = await conn.fetchval("SELECT count(*) FROM schema_migration")
            nodes = await conn.fetchval("SELECT count(*) FROM id_node_lease")
        finally:
            await conn.close()
        assert applied == len(sql.migrations()) and nodes == 1024  # every migration file made it into the wheel

        proc = await asyncio.create_subprocess_exec(python, "-m", "services.submit", env=env, cwd=tmp_path,
                                                    stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE)
        try:
            async def serving() -> bool:
                assert proc.returncode is None, "the submit service exited"
                async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                    try:
                        reply = await health_pb2_grpc.HealthStub(channel).Check(
                            health_pb2.HealthCheckRequest(), timeout=1
                        )
                    except grpc.aio.AioRpcError:
                        return False
                    return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)

            await wait_for(serving, within=120, every=0.2)
        finally:
            if proc.returncode is None:
                proc.terminate()
            _, err = await asyncio.wait_for(proc.communicate(), 60)
        assert proc.returncode == 0, err.decode()[-2000:]
        origin = await asyncio.to_thread(
            _run, [python, "-c", "import taskgate.sql; print(taskgate.sql.HERE)"], env=env, cwd=tmp_path
        )
        assert "site-packages" in origin  # the installed copy, not the checkout
    finally:
        await admin.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
        await admin.close()
