"""How the SDK reaches the gateway: addresses of the three public services, the key, TLS, retries."""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TypedDict

import grpc

from taskgate_api.version import __version__

DEFAULT_ADDRESS = "127.0.0.1:50051"
EVENTS_PORT = 50052
ADMIN_PORT = 50053

CertSource = bytes | str | Path | None


def _read(source: CertSource) -> bytes | None:
    """PEM bytes from bytes, or from a file path given as str/Path."""
    if source is None or isinstance(source, bytes):
        return source
    return Path(source).expanduser().read_bytes()


# The shipped manifests' Service names (deploy/k8s): events and admin are other Services than the gateway.
SUBMIT_SERVICE = "taskgate-submit"
SIBLING_SERVICES = {EVENTS_PORT: "taskgate-notifier", ADMIN_PORT: "taskgate-scheduler"}
_SCHEMES = ("dns:///", "ipv4:", "ipv6:")


def _sibling_host(host: str, port: int) -> str:
    """`taskgate-submit[.namespace...]` becomes the sibling Service of the same namespace; any other host stays."""
    name, dot, domain = host.partition(".")
    if name == SUBMIT_SERVICE and port in SIBLING_SERVICES:
        return SIBLING_SERVICES[port] + dot + domain
    return host


def sibling_address(address: str, port: int) -> str:
    """The same host(s) as `address` with another port; the shipped manifests' submit Service names its sibling.

    "gw:50051" -> "gw:50052"; "[::1]:1" -> "[::1]:50052"; "ipv4:10.0.0.1:1,10.0.0.2:1" -> each address on `port`;
    "taskgate-submit.prod.svc:50051" -> "taskgate-notifier.prod.svc:50052" (events) or "taskgate-scheduler...:50053".
    """
    scheme = ""
    rest = address
    for prefix in _SCHEMES:
        if rest.startswith(prefix):
            scheme, rest = prefix, rest[len(prefix) :]
            break
    if rest.startswith("unix:"):
        raise ValueError(f"cannot derive a sibling of {address!r}: give events_address/admin_address explicitly")
    out = []
    for one in rest.split(",") if scheme in ("ipv4:", "ipv6:") else [rest]:
        if one.startswith("["):
            host = one[: one.index("]") + 1]
        elif ":" in one:
            host = one.rsplit(":", 1)[0]
        else:
            host = one
        out.append(f"{_sibling_host(host, port)}:{port}")
    return scheme + ",".join(out)


def channel_target(address: str) -> str:
    """The gRPC target: a bare "host:port" goes through the DNS resolver (every address of a headless Service)."""
    if address.startswith((*_SCHEMES, "dns:", "unix:", "unix-abstract:", "vsock:")):
        return address
    return "dns:///" + address


@dataclass(frozen=True, slots=True)
class ClientConfig:
    """Everything a client needs to connect; `resolved()` fills the defaults."""

    address: str = DEFAULT_ADDRESS
    api_key: str | None = None
    events_address: str | None = None
    admin_address: str | None = None
    admin_key: str | None = None
    tls: bool = False
    root_certificates: bytes | None = None
    client_cert: bytes | None = None
    client_key: bytes | None = None
    tls_server_name: str | None = None
    call_timeout: float = 30.0
    retry_attempts: int = 5
    retry_max_delay: float = 5.0
    watch_resume_attempts: int = 8
    # submit() and chat() over one SubmitStream per channel (pipelined; unary SubmitTask where the server lacks it)
    submit_stream: bool = True

    def resolved(self) -> ClientConfig:
        """Events on port 50052 and admin on port 50053 of the gateway's host (or sibling Service) unless given."""
        return replace(
            self,
            events_address=self.events_address or sibling_address(self.address, EVENTS_PORT),
            admin_address=self.admin_address or sibling_address(self.address, ADMIN_PORT),
            tls=self.tls or any(x is not None for x in (self.root_certificates, self.client_cert, self.client_key)),
        )

    def channel_credentials(self) -> grpc.ChannelCredentials | None:
        """TLS credentials (server roots, optional client certificate for mutual TLS), or None for plaintext."""
        if not self.tls:
            return None
        return grpc.ssl_channel_credentials(self.root_certificates, self.client_key, self.client_cert)

    def channel_options(self) -> list[tuple[str, object]]:
        options: list[tuple[str, object]] = [
            ("grpc.primary_user_agent", f"taskgate-sdk/{__version__}"),
            ("grpc.max_receive_message_length", 16 * 1024 * 1024),
            ("grpc.keepalive_time_ms", 30_000),
            ("grpc.keepalive_timeout_ms", 10_000),
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.enable_retries", 0),
            # one subchannel per address the target resolves to (every pod of a headless Service), calls spread over
            # the ready ones; a pod that closes a connection for its age makes the channel resolve the name again
            ("grpc.lb_policy_name", "round_robin"),
        ]
        if self.tls_server_name:
            options.append(("grpc.ssl_target_name_override", self.tls_server_name))
        return options


class ConnectOptions(TypedDict, total=False):
    """The keyword options of connect() / connect_async(), as make_config takes them."""

    events_address: str | None
    admin_address: str | None
    admin_key: str | None
    tls: bool
    root_certificates: CertSource
    client_cert: CertSource
    client_key: CertSource
    tls_server_name: str | None
    call_timeout: float
    retry_attempts: int
    submit_stream: bool


def make_config(
    address: str | None = None,
    api_key: str | None = None,
    *,
    events_address: str | None = None,
    admin_address: str | None = None,
    admin_key: str | None = None,
    tls: bool = False,
    root_certificates: CertSource = None,
    client_cert: CertSource = None,
    client_key: CertSource = None,
    tls_server_name: str | None = None,
    call_timeout: float = 30.0,
    retry_attempts: int = 5,
    submit_stream: bool = True,
) -> ClientConfig:
    """A resolved config; unset address/key fall back to TASKGATE_ADDRESS / TASKGATE_API_KEY / TASKGATE_ADMIN_KEY."""
    if retry_attempts < 1:
        raise ValueError("retry_attempts must be at least 1")
    return ClientConfig(
        address=address or os.environ.get("TASKGATE_ADDRESS") or DEFAULT_ADDRESS,
        api_key=api_key or os.environ.get("TASKGATE_API_KEY") or None,
        events_address=events_address or os.environ.get("TASKGATE_EVENTS_ADDRESS") or None,
        admin_address=admin_address or os.environ.get("TASKGATE_ADMIN_ADDRESS") or None,
        admin_key=admin_key or os.environ.get("TASKGATE_ADMIN_KEY") or None,
        tls=tls,
        root_certificates=_read(root_certificates),
        client_cert=_read(client_cert),
        client_key=_read(client_key),
        tls_server_name=tls_server_name,
        call_timeout=call_timeout,
        retry_attempts=retry_attempts,
        submit_stream=submit_stream,
    ).resolved()
