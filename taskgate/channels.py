"""Channels from one taskgate service to another (the HTTP face to the API services, the dashboard and workers to
TaskAdmin and WorkerControl): TLS, verified against `tls_ca_file`, whenever the deployment configures it."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import grpc

from taskgate.config import CommonSettings

WORKER_TLS_NAME = "taskgate-worker"  # workers are reached by pod IP: their certificate names them so


def local_target(settings: CommonSettings, port: int) -> str:
    """This host's address of a service on `port` (the bind address, or loopback for a wildcard bind)."""
    host = "127.0.0.1" if settings.grpc_host in ("0.0.0.0", "::") else settings.grpc_host
    return f"{host}:{port}"


def credentials(settings: CommonSettings) -> grpc.ChannelCredentials | None:
    """Verifies servers against tls_ca_file, presenting this service's own certificate (for mutual TLS) when it has
    one; None when the deployment configures no CA (plaintext, loopback or a trusted network only)."""
    if settings.tls_ca_file is None:
        return None
    chain: tuple[bytes | None, bytes | None] = (None, None)
    if settings.tls_cert_file is not None and settings.tls_key_file is not None:
        chain = (settings.tls_key_file.read_bytes(), settings.tls_cert_file.read_bytes())
    return grpc.ssl_channel_credentials(settings.tls_ca_file.read_bytes(), *chain)


def channel(
    settings: CommonSettings, target: str, options: Sequence[tuple[str, Any]] = (), *, server_name: str | None = None
) -> grpc.aio.Channel:
    """A channel to another taskgate service at `target`, TLS when configured; `server_name`: the name its certificate
    must carry when `target` is an address (a worker's pod IP)."""
    creds = credentials(settings)
    if creds is None:
        return grpc.aio.insecure_channel(target, options=list(options))
    named = [("grpc.ssl_target_name_override", server_name)] if server_name else []
    return grpc.aio.secure_channel(target, creds, options=[*options, *named])
