"""TLS by default outside loopback: a gRPC service refuses plaintext on an address other hosts reach unless told the
network is trusted; with TLS, kubelet's plaintext probes have a health-only port; the services' own calls to each
other verify the servers' certificates against the deployment's CA."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from nats.errors import Error as NatsError

from services.http.service import start as start_http
from services.submit.service import start as start_submit
from taskgate import auth, bus
from taskgate.config import Settings
from taskgate.runtime import Backends, connect
from taskgate.server import READINESS, PlaintextRefused, is_loopback
from taskgate_api.v1 import gateway_pb2, gateway_pb2_grpc
from taskgate_local.embedded import EmbeddedNats
from tests.support.harness import LocalCA, make_local_ca


@pytest.fixture
def ca(tmp_path: Path) -> LocalCA:
    return make_local_ca(tmp_path / "pki")


def with_tls(settings: Settings, ca: LocalCA, **update: object) -> Settings:
    return settings.model_copy(
        update={"tls_cert_file": ca.cert_file, "tls_key_file": ca.key_file, "tls_ca_file": ca.ca_file, **update}
    )


def test_loopback_addresses() -> None:
    assert all(is_loopback(h) for h in ("127.0.0.1", "127.8.9.1", "::1", "[::1]", "localhost"))
    assert not any(is_loopback(h) for h in ("0.0.0.0", "::", "10.1.2.3", "taskgate-submit"))


async def test_plaintext_on_a_reachable_address_is_refused_unless_the_network_is_declared_trusted(
    settings: Settings, backends: Backends
) -> None:
    wide = settings.model_copy(update={"grpc_host": "0.0.0.0"})
    with pytest.raises(PlaintextRefused, match="TASKGATE_TLS_CERT_FILE"):
        await start_submit(wide, backends)
    handle = await start_submit(wide.model_copy(update={"grpc_allow_plaintext": True}), backends)
    await handle.stop(0)


async def test_a_tls_service_serves_its_api_over_tls_only_and_its_health_in_plaintext_on_the_health_port(
    settings: Settings, backends: Backends, ca: LocalCA
) -> None:
    key, _ = await auth.create_key(backends.pool, settings.api_key_pepper, "tenant-a")
    handle = await start_submit(with_tls(settings, ca, grpc_host="0.0.0.0", grpc_health_port=0), backends)
    try:
        creds = grpc.ssl_channel_credentials(ca.ca_file.read_bytes())
        async with grpc.aio.secure_channel(f"localhost:{handle.port}", creds) as channel:
            listed = await gateway_pb2_grpc.TaskGatewayStub(channel).ListTasks(
                gateway_pb2.ListTasksRequest(), metadata=(("authorization", f"Bearer {key}"),)
            )
            assert list(listed.tasks) == []
        async with grpc.aio.insecure_channel(f"127.0.0.1:{handle.port}") as channel:  # plaintext to the TLS port
            with pytest.raises(grpc.aio.AioRpcError) as plain:
                await gateway_pb2_grpc.TaskGatewayStub(channel).ListTasks(gateway_pb2.ListTasksRequest(), timeout=3)
            assert plain.value.code() == grpc.StatusCode.UNAVAILABLE
        async with grpc.aio.insecure_channel(f"127.0.0.1:{handle.health.plain_port}") as channel:
            answer = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=READINESS))
            assert answer.status == health_pb2.HealthCheckResponse.SERVING
            with pytest.raises(grpc.aio.AioRpcError) as api:  # the health port serves nothing else
                await gateway_pb2_grpc.TaskGatewayStub(channel).ListTasks(gateway_pb2.ListTasksRequest(), timeout=3)
            assert api.value.code() == grpc.StatusCode.UNIMPLEMENTED
    finally:
        await handle.stop(0)


async def test_the_http_face_verifies_its_tls_upstream_against_the_deployment_ca(
    settings: Settings, backends: Backends, ca: LocalCA, tmp_path: Path
) -> None:
    key, _ = await auth.create_key(backends.pool, settings.api_key_pepper, "tenant-a")
    tls = with_tls(settings, ca, http_port=0, http_metrics_port=0)
    submit = await start_submit(tls, backends)
    stranger = make_local_ca(tmp_path / "another-pki")  # a CA that did not sign the server's certificate
    untrusting = tls.model_copy(update={"tls_ca_file": stranger.ca_file})
    faces = [await start_http(tls.model_copy(update={"http_gateway_target": f"localhost:{submit.port}"})),
             await start_http(untrusting.model_copy(update={"http_gateway_target": f"localhost:{submit.port}"}))]
    try:
        async with httpx.AsyncClient(headers={"authorization": f"Bearer {key}"}, timeout=10) as client:
            trusted = await client.get(f"http://127.0.0.1:{faces[0].port}/v1/tasks")
            assert trusted.status_code == 200 and trusted.json().get("tasks", []) == []
            refused = await client.get(f"http://127.0.0.1:{faces[1].port}/v1/tasks")
            assert refused.status_code == 503  # the upstream's certificate did not verify: never sent in the clear
    finally:
        for face in faces:
            await face.stop()
        await submit.stop(0)


async def test_a_service_reaches_nats_over_tls_verified_against_the_deployment_ca(
    settings: Settings, ca: LocalCA, tmp_path: Path
) -> None:
    server = EmbeddedNats(
        tmp_path / "nats", args=("--tls", "--tlscert", str(ca.cert_file), "--tlskey", str(ca.key_file))
    ).start()
    try:
        url = f"tls://localhost:{server.port}"
        connected = await bus.connect(url, "tls-check", tls_ca_file=ca.ca_file)
        try:
            await connected.nc.flush(timeout=5)
            assert connected.nc.is_connected and connected.nc.connected_url is not None
            assert connected.nc.connected_url.scheme == "tls"
        finally:
            await connected.close()
        stranger = make_local_ca(tmp_path / "another-pki")
        with pytest.raises((TimeoutError, NatsError, OSError)):  # the server's certificate does not verify
            await asyncio.wait_for(bus.connect(url, "tls-check", tls_ca_file=stranger.ca_file), 5)
        assert "TLS handshake error" in (server.store_dir / "nats.log").read_text()
        backends = await connect(settings.model_copy(update={"nats_url": url, "nats_tls_ca_file": ca.ca_file}), "tls")
        await backends.close()
    finally:
        server.stop()
