"""Real PostgreSQL and NATS for the whole session; each test gets its own database and clean streams."""

from __future__ import annotations

import asyncio
import atexit
import getpass
import io
import itertools
import os
import signal
import sys
import tempfile
import threading
from collections.abc import AsyncIterator, Generator, Iterator
from pathlib import Path
from types import FrameType
from typing import Any

import asyncpg
import grpc
import nats
import pytest
from _pytest.pathlib import make_numbered_dir_with_cleanup

from services.notifier import service as notifier_service
from services.scheduler import service as scheduler_service
from services.submit import service as submit_service
from services.submit.service import SubmitHandle
from services.submit.service import start as start_submit
from taskgate import auth
from taskgate import bus as busmod
from taskgate.config import ModelSpec, Settings
from taskgate.migrate import migrate
from taskgate.runtime import Backends, connect
from taskgate_api.v1 import gateway_pb2_grpc
from taskgate_local.embedded import EmbeddedStack
from tests.support import grpcleaks, llamaserver, sleepy
from tests.support.factories import settings_for
from tests.support.harness import ROOT, WorkerFactory, with_database
from tests.support.llamaserver import LlamaServer
from tests.support.s3server import SeaweedS3
from tests.support.stacks import Cli

TEMPLATE = "taskgate_template"
_counter = itertools.count()
WATCHDOG_MARGIN_SECONDS = 20.0
DROP_SECONDS = 30.0


def _dump_asyncio_tasks(_signum: int, _frame: FrameType | None) -> None:
    """SIGUSR1: prints every asyncio task's stack (runs in the main thread, inside the hung loop)."""
    try:
        tasks = asyncio.all_tasks()
    except RuntimeError:
        return  # no loop running: pytest-timeout's thread dump says it all
    out = io.StringIO()
    print(f"\n=== about to time out; {len(tasks)} asyncio tasks ===", file=out)
    for task in tasks:
        print(f"--- {task!r}", file=out)
        for frame in task.get_stack(limit=12):  # not print_stack: Cython frames have no line number
            print(f"  {frame.f_code.co_filename}:{frame.f_lineno} in {frame.f_code.co_name}", file=out)
    if sys.__stderr__ is not None:  # past pytest's capture: the dump must reach CI's log
        sys.__stderr__.write(out.getvalue())


KEEP_RUNS = 3  # as pytest keeps its own


@pytest.hookimpl(tryfirst=True)  # before pytest's tmpdir plugin reads --basetemp
def pytest_configure(config: pytest.Config) -> None:
    signal.signal(signal.SIGUSR1, _dump_asyncio_tasks)
    grpcleaks.install()
    if config.option.basetemp is None:
        config.option.basetemp = str(_run_folder())


def _run_folder() -> Path:
    """This session's temporary folder, numbered as pytest numbers its own, under /tmp/taskgate-tests-<user>.

    Not under /tmp/pytest-of-<user>: every new pytest session resets that folder to mode 0700, and an embedded
    PostgreSQL beneath it, running as its own user when we are root, then loses its data directory and stops ('could
    not stat data directory'): seen when `pytest tests/unit` ran while `make test` did."""
    root = Path(tempfile.gettempdir()) / f"taskgate-tests-{getpass.getuser()}"
    root.mkdir(exist_ok=True)
    root.chmod(0o755)
    lock_timeout = 3 * 24 * 3600.0  # a crashed session's folder is anybody's after three days
    numbered = make_numbered_dir_with_cleanup(
        root=root, prefix="run-", mode=0o755, keep=KEEP_RUNS, lock_timeout=lock_timeout, register=atexit.register
    )
    # pytest empties a given --basetemp; a folder inside keeps the numbered one's lock, which stops a later session's
    # clean-up from deleting it while this one runs
    return numbered / "session"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Generator[None, None, None]:
    """Shortly before pytest-timeout fires, dumps the asyncio tasks: pytest-timeout shows only threads, and a hang
    in async code (a teardown awaiting forever) is otherwise one stack of `select()`."""
    marker = item.get_closest_marker("timeout")
    limit = float(marker.args[0]) if marker and marker.args else float(item.config.getini("timeout") or 0)
    timer = None
    if limit > WATCHDOG_MARGIN_SECONDS:
        timer = threading.Timer(limit - WATCHDOG_MARGIN_SECONDS, os.kill, (os.getpid(), signal.SIGUSR1))
        timer.daemon = True
        timer.start()
    try:
        yield
    finally:
        if timer is not None:
            timer.cancel()




@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Generator[None, None, None]:
    """A grpc.aio server still running after its test's event loop closed is an error of that test: it can never be
    stopped, and it would hang the process at exit in grpc.aio's shutdown (tests/support/grpcleaks.py says why)."""
    result = yield
    if found := grpcleaks.leaked():
        raise AssertionError(
            f"{len(found)} grpc.aio server(s) left running after the test's event loop closed (never "
            f"stopped: the process would hang at exit), created at: " + "; ".join(found)
        )
    return result


@pytest.fixture(scope="session")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str]]:
    """Embedded servers for the session, or TASKGATE_TEST_DATABASE_URL / TASKGATE_TEST_NATS_URL when given."""
    db, nc = os.environ.get("TASKGATE_TEST_DATABASE_URL"), os.environ.get("TASKGATE_TEST_NATS_URL")
    if db and nc:
        yield db, nc
        return
    base = tmp_path_factory.mktemp("stack")
    base.chmod(0o755)
    stack = EmbeddedStack(base).start()
    assert stack.postgres is not None and stack.nats is not None
    try:
        yield stack.postgres.url, stack.nats.url
    finally:
        stack.stop()


@pytest.fixture(scope="session")
def template_url(servers: tuple[str, str]) -> str:
    """A migrated template database; test databases are cheap copies of it."""

    async def build() -> None:
        conn = await asyncpg.connect(servers[0])
        try:
            await conn.execute(f"DROP DATABASE IF EXISTS {TEMPLATE} WITH (FORCE)")
            await conn.execute(f"CREATE DATABASE {TEMPLATE}")
        finally:
            await conn.close()
        conn = await asyncpg.connect(with_database(servers[0], TEMPLATE))
        try:
            await migrate(conn)
        finally:
            await conn.close()

    asyncio.run(build())
    return with_database(servers[0], TEMPLATE)


@pytest.fixture
async def database_url(servers: tuple[str, str], template_url: str) -> AsyncIterator[str]:
    name = f"t_{os.getpid()}_{next(_counter)}"
    conn = await asyncpg.connect(servers[0])
    try:
        await conn.execute(f"CREATE DATABASE {name} TEMPLATE {TEMPLATE}")
    finally:
        await conn.close()
    yield with_database(servers[0], name)
    # Bounded: a backend that cannot take the drop's barrier (say, one blocked writing to a client that stopped
    # reading) must not hang the run; a leftover test database costs only disk.
    conn = await asyncpg.connect(servers[0], timeout=DROP_SECONDS)
    try:
        await conn.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)", timeout=DROP_SECONDS)
    except (TimeoutError, asyncpg.PostgresError) as exc:
        if sys.__stderr__ is not None:
            sys.__stderr__.write(f"\nleft test database {name} behind: {type(exc).__name__}: {exc}\n")
    finally:
        conn.terminate()


@pytest.fixture
async def nats_url(servers: tuple[str, str]) -> str:
    """The session's NATS with every taskgate stream and bucket removed, so each test starts empty."""
    nc = await nats.connect(servers[1])
    js = nc.jetstream()
    try:
        for name in await js.streams_info():
            assert name.config.name is not None
            await js.delete_stream(name.config.name)
    finally:
        await nc.close()
    return servers[1]


@pytest.fixture
def settings(database_url: str, nats_url: str, tmp_path: Path) -> Settings:
    """Settings for one test: its own database, clean streams, ephemeral ports, short timeouts."""
    return settings_for(tmp_path, database_url=database_url, nats_url=nats_url)


@pytest.fixture
async def backends(settings: Settings) -> AsyncIterator[Backends]:
    """Connected pool and bus, migrated and declared."""
    b = await connect(settings, "test")
    try:
        yield b
    finally:
        await b.close()



@pytest.fixture
async def gateway(settings: Settings, backends: Backends) -> AsyncIterator[SubmitHandle]:
    """A submit service on an ephemeral port over the test's backends."""
    handle = await start_submit(settings, backends)
    try:
        yield handle
    finally:
        await handle.stop(0)


@pytest.fixture
async def stub(gateway: SubmitHandle) -> AsyncIterator[gateway_pb2_grpc.TaskGatewayAsyncStub]:
    """A TaskGateway stub over a real channel to `gateway`."""
    async with grpc.aio.insecure_channel(f"127.0.0.1:{gateway.port}") as channel:
        yield gateway_pb2_grpc.TaskGatewayStub(channel)  # type: ignore[misc]


__all__ = ["busmod"]


@pytest.fixture
async def workers() -> AsyncIterator[WorkerFactory]:
    """Starts workers on demand (settings, plus any field to change); drains every one still running, with no grace,
    at the end."""
    from services.worker.engine import TestSignals  # late: torch is imported only by tests that run workers
    from services.worker.service import WorkerHandle, start

    started: list[WorkerHandle] = []

    async def make(settings: Settings, **update: Any) -> WorkerHandle:
        handle = await start(settings.model_copy(update=update) if update else settings, signals=TestSignals().arm())
        started.append(handle)
        return handle

    yield make
    for handle in started:
        await handle.stop(grace=0)


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SeaweedS3]:
    """A real S3-compatible server (SeaweedFS) for the session, started only when a test asks for it."""
    server = SeaweedS3(tmp_path_factory.mktemp("s3")).start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def tiny_lm(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny random-weight chat model (taskgate_local.tinylm), built once per session when a test asks for it."""
    from taskgate_local import tinylm  # late: it imports transformers when building

    return tinylm.build_tiny_lm(tmp_path_factory.mktemp("models") / tinylm.MODEL_NAME, seed=0)


@pytest.fixture(scope="session")
def llama_server(tmp_path_factory: pytest.TempPathFactory, tiny_lm: Path) -> Iterator[LlamaServer]:
    """A real OpenAI-compatible server (llama.cpp's, from llama-cpp-python) serving the tiny chat model as a GGUF, with
    an API key, for the session; the test skips, saying why, where llama-cpp-python could not be built."""
    why = llamaserver.missing()
    if why is not None:
        pytest.skip(why)
    from taskgate_local.tinygguf import convert

    base = tmp_path_factory.mktemp("llama")
    model = convert(tiny_lm, base / "tiny-chat.gguf")
    server = LlamaServer(base, model, alias="tiny-chat-upstream", api_key="sk-test-" + os.urandom(8).hex()).start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
async def cli(settings: Settings, backends: Backends, tmp_path: Path) -> AsyncIterator[Cli]:
    """The CLI's stack: the four services in this process (a worker for sleep models), a tenant and an admin key."""
    from services.worker import service as worker_service  # late, as in `workers`

    models = {
        **settings.models,
        "sleepy": ModelSpec(kind="sleep", sleep_seconds=0.6, default_steps=3),
        "failing": sleepy.spec(fail_times=9, fail_retryable=False, fail_code="MODEL_CRASHED"),
        "sleepy-i2v": ModelSpec(kind="sleep", task_types=["image-to-video"]),
    }
    # progress at most once per interval, the claim counting as the first write: a short interval shows 0.2 s steps
    settings = settings.model_copy(
        update={
            "models": models,
            "worker_models": ["sleepy", "failing", "sleepy-i2v"],
            "progress_interval_seconds": 0.05,
        }
    )
    submit = await submit_service.start(settings, backends)
    scheduler = await scheduler_service.start(settings, backends, scan_loop=False)
    notifier = await notifier_service.start(settings)
    worker = await worker_service.start(settings)
    api_key, _ = await auth.create_key(
        backends.pool, settings.api_key_pepper, "tenant-a", max_pending=50, submits_per_minute=1000
    )
    admin_key, _ = await auth.create_key(backends.pool, settings.api_key_pepper, "ops", admin=True)
    env = {
        k: v for k, v in os.environ.items() if not k.startswith("TASKGATE_")
    } | {
        "TASKGATE_ADDRESS": f"127.0.0.1:{submit.port}",
        "TASKGATE_EVENTS_ADDRESS": f"127.0.0.1:{notifier.port}",
        "TASKGATE_ADMIN_ADDRESS": f"127.0.0.1:{scheduler.port}",
        "TASKGATE_API_KEY": api_key,
        "TASKGATE_ADMIN_KEY": admin_key,
        "TASKGATE_STATE_DIR": str(tmp_path / "state"),
        "TASKGATE_DATABASE_URL": settings.database_url or "",
        "TASKGATE_NATS_URL": settings.nats_url or "",
        # the checkout under test, whatever an editable install of the environment points at (a shared one may point
        # at another worktree: its code then met this test's database)
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    }
    try:
        yield Cli(env, tmp_path, settings, backends)
    finally:
        await worker.stop(1.0)
        await notifier.stop()
        await scheduler.stop(0)
        await submit.stop(0)


_EXIT_GRACE_SECONDS = 120.0


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """A watchdog for the interpreter's own exit: a session whose tests have ended but whose process does not exits with
    the session's status after a grace, instead of holding CI until its limit. The one cause seen (test_http.py: a
    restarted notifier never stopped, so grpc.aio's shutdown in pytest's last garbage collection waited for ever on its
    poller thread) is fixed, and pytest_runtest_teardown now fails the test that leaves a grpc.aio server running; this
    stays as the backstop for such a test (the run fails, and ends) and for any other exit that blocks."""
    status = int(exitstatus)

    def _exit_late() -> None:
        threading.Event().wait(_EXIT_GRACE_SECONDS)
        sys.stderr.write(f"pytest: the process did not exit {_EXIT_GRACE_SECONDS:.0f} s after the session; exiting\n")
        sys.stderr.flush()
        os._exit(status)

    threading.Thread(target=_exit_late, name="exit-watchdog", daemon=True).start()
