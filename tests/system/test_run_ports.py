"""make run refuses ports another server already listens on (gRPC's SO_REUSEPORT would otherwise share them)."""

from __future__ import annotations

import socket

import pytest

from taskgate.config import Settings
from taskgate_local.dev import busy_ports
from taskgate_local.embedded import free_port


def test_a_port_in_use_is_reported_by_its_variable() -> None:
    no_metrics = {f"{name}_metrics_port": 0 for name in ("submit", "notifier", "scheduler", "worker")}
    settings = Settings(**no_metrics)  # type: ignore[arg-type]
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as a gRPC server binds
        taken.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        ports = {"submit": port, "notifier": free_port(), "scheduler": free_port(), "worker": free_port()}
        assert busy_ports(settings, ports) == [f"{port} (TASKGATE_SUBMIT_PORT)"]
    assert busy_ports(settings, ports) == []


def test_a_connection_left_in_time_wait_is_no_listener() -> None:
    """A second `make run` right after Ctrl-C: the last run's connections linger in TIME_WAIT for about a minute."""
    no_metrics = {f"{name}_metrics_port": 0 for name in ("submit", "notifier", "scheduler", "worker")}
    settings = Settings(**no_metrics)  # type: ignore[arg-type]
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as server:
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as a gRPC server binds
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        client = socket.create_connection(("127.0.0.1", port))
        accepted, _ = server.accept()
        accepted.close()  # the server closes first, so its end of the connection waits in TIME_WAIT
        assert client.recv(1) == b""
        client.close()
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as plain, pytest.raises(OSError):
        plain.bind(("127.0.0.1", port))  # the control: a probe without SO_REUSEADDR calls the port busy
    ports = {"submit": port, "notifier": free_port(), "scheduler": free_port(), "worker": free_port()}
    assert busy_ports(settings, ports) == []
