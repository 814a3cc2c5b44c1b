"""make run refuses ports another server already listens on (gRPC's SO_REUSEPORT would otherwise share them)."""

from __future__ import annotations

import socket

from taskgate.config import Settings
from taskgate_local.dev import busy_ports
from taskgate_local.embedded import free_port


def test_a_port_in_use_is_reported_by_its_variable() -> None:
    no_metrics = {f"{name}_metrics_port": 0 for name in ("submit", "notifier", "scheduler", "worker")}
    settings = Settings(**no_metrics)  # type: ignore[arg-type]
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)  # as a gRPC server binds
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        ports = {"submit": port, "notifier": free_port(), "scheduler": free_port(), "worker": free_port()}
        assert busy_ports(settings, ports) == [f"{port} (TASKGATE_SUBMIT_PORT)"]
    assert busy_ports(settings, ports) == []
