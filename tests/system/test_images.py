"""The images, run as compose.yaml and the Kubernetes manifests run them.

The `images` test (`make test-images`, after `make images`; not part of `make test`) starts PostgreSQL and NATS from
compose.yaml's images (TASKGATE_POSTGRES_IMAGE / TASKGATE_NATS_IMAGE replace them), then migrate, the tiny model and
the services from the built images with compose.yaml's commands, environment, volumes and hardening (uid 10001,
read-only root, no capabilities), on host networking with free ports. It creates a key with `taskgate-keys` inside
the submit container, submits a task end to end with the `taskgate` command, downloads and decodes the MP4, then
stops every service with SIGTERM while a task runs on the worker and checks each exit status is 0 and the task
finished. The checks without an engine compare compose.yaml with the manifests and the Dockerfile.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import asyncpg
import av
import httpx
import pytest
import yaml

from taskgate.config import Settings
from taskgate_local import digests
from taskgate_local.embedded import free_port
from taskgate_local.images import OFFICIAL_BASE, STANDINS, engine, image_exists
from tests.support.harness import ROOT, serving, wait_for

COMPOSE: dict[str, Any] = yaml.safe_load((ROOT / "compose.yaml").read_text())
SERVICES = COMPOSE["services"]
TASKGATE = [name for name, spec in SERVICES.items() if "TASKGATE_DATABASE_URL" in spec.get("environment", {})]
GRPC = {"submit": "submit_port", "notifier": "notifier_port", "scheduler": "scheduler_port", "worker": "worker_port"}
METRICS = {name: f"{name}_metrics_port" for name in (*GRPC, "http")}
TAG = os.environ.get("TASKGATE_IMAGE_TAG", "dev")


def expand(text: str) -> str:
    """Compose's `${VAR:-default}` interpolation (the only form compose.yaml uses)."""
    return re.sub(r"\$\{(\w+):-([^}]*)\}", lambda m: os.environ.get(m.group(1)) or m.group(2), text)


def manifest_containers() -> dict[str, dict[str, Any]]:
    """The container of every Deployment and Job in deploy/k8s/base, by the process its command starts."""
    found: dict[str, dict[str, Any]] = {}
    for path in sorted((ROOT / "deploy" / "k8s" / "base").glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc and doc["kind"] in ("Deployment", "Job"):
                pod = doc["spec"]["template"]["spec"]
                for container in pod["containers"]:
                    found[container["command"][-1]] = {**container, "pod": pod}
    return found


def test_compose_runs_every_service_as_the_manifests_do() -> None:
    manifests = manifest_containers()
    settings = set(Settings.model_fields)
    for name in TASKGATE:
        spec = SERVICES[name]
        command = spec["command"]
        image = expand(spec["image"]).split(":")[0]
        assert image in {"taskgate-api", "taskgate"}, f"{name}: {image} is no Dockerfile target make images builds"
        assert spec["user"] == "10001:10001" and spec["read_only"] is True and spec["cap_drop"] == ["ALL"], name
        assert "/tmp" in spec["tmpfs"], f"{name}: HOME and caches are under /tmp, which needs a writable mount"
        for key in spec["environment"]:
            assert key.removeprefix("TASKGATE_").lower() in settings, f"{name}: {key} is no setting"
        if command[-1] in manifests:
            manifest = manifests[command[-1]]
            assert command == manifest["command"], name
            assert image == manifest["image"], f"{name}: the manifests run {command[-1]} from {manifest['image']}"
            assert manifest["pod"]["securityContext"]["runAsUser"] == 10001
    started = {spec["command"][-1] for spec in SERVICES.values() if "command" in spec}
    assert {c for c in manifests} <= started, "compose.yaml runs every process the manifests run"
    # the worker's SIGTERM drain fits in compose's grace before SIGKILL
    drain = float(SERVICES["worker"]["environment"]["TASKGATE_DRAIN_GRACE_SECONDS"])
    assert float(SERVICES["worker"]["stop_grace_period"].removesuffix("s")) > drain


def test_compose_images_default_to_official_and_are_replaceable() -> None:
    assert expand(SERVICES["postgres"]["image"]).startswith("docker.io/library/postgres:")
    assert expand(SERVICES["nats"]["image"]).startswith("docker.io/library/nats:")
    assert SERVICES["postgres"]["image"].startswith("${TASKGATE_POSTGRES_IMAGE:-")
    assert SERVICES["nats"]["image"].startswith("${TASKGATE_NATS_IMAGE:-")


def test_every_third_party_image_is_pinned_by_digest() -> None:
    refs = digests.references()
    named = {ref.tagged.rsplit("/", 1)[-1].split(":")[0] for ref in refs}
    assert {"python", "postgres", "nats", "postgresql"} <= named, (
        "the base, compose's and the manifests' images are all seen"
    )
    assert {ref.path.name for ref in refs} >= {"Dockerfile", "compose.yaml", "nats.yaml", "postgres.yaml"}
    assert digests.main(["--check"]) == 0, "every third-party image as name:tag@sha256:<digest> (make pin-digests)"
    assert OFFICIAL_BASE in {ref.ref for ref in refs}, (
        "make images and container_host.sh use the Dockerfile's pinned base"
    )
    # taskgate's own images are the release's to pin (kustomize images: digest:), as deploy/README.md says
    assert not [ref for ref in refs if ref.tagged.rsplit("/", 1)[-1].startswith("taskgate")]
    assert "digest:" in (ROOT / "deploy" / "README.md").read_text()


@dataclass
class Stack:
    """Containers named `<project>-<service>`, started from compose.yaml's definitions on host networking."""

    tool: str
    project: str
    tmp: Path
    ports: dict[str, int] = field(default_factory=dict)
    started: list[str] = field(default_factory=list)
    volumes: set[str] = field(default_factory=set)
    api_key: str = ""

    def name(self, service: str) -> str:
        return f"{self.project}-{service}"

    def engine(self, *args: str, check: bool = True, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        done = subprocess.run([self.tool, *args], capture_output=True, text=True, timeout=timeout)
        if check and done.returncode != 0:
            raise AssertionError(f"{self.tool} {' '.join(args)}: {done.returncode}\n{done.stderr[-3000:]}")
        return done

    def env(self, service: str) -> dict[str, str]:
        """compose.yaml's environment, with the addresses of this host network and its free ports."""
        env = {key: expand(str(value)) for key, value in SERVICES[service].get("environment", {}).items()}
        if service in TASKGATE:
            password = expand("${TASKGATE_POSTGRES_PASSWORD:-taskgate-dev}")
            env["TASKGATE_DATABASE_URL"] = f"postgresql://taskgate:{password}@127.0.0.1:{self.ports['postgres']}/taskgate"
            env["TASKGATE_NATS_URL"] = f"nats://127.0.0.1:{self.ports['nats']}"
            env["TASKGATE_GRPC_HOST"] = env["TASKGATE_METRICS_HOST"] = env["TASKGATE_HTTP_HOST"] = "127.0.0.1"
            env["TASKGATE_WORKER_ADVERTISE_HOST"] = "127.0.0.1"
            env["TASKGATE_HTTP_PORT"] = str(self.ports["http"])
            for process, setting in GRPC.items():
                env[f"TASKGATE_{setting.upper()}"] = str(self.ports[process])
            for setting in METRICS.values():
                env[f"TASKGATE_{setting.upper()}"] = str(self.ports[setting])
            for process, setting in (("GATEWAY", "submit"), ("EVENTS", "notifier"), ("ADMIN", "scheduler")):
                env[f"TASKGATE_HTTP_{process}_TARGET"] = f"127.0.0.1:{self.ports[setting]}"
        return env

    def run(self, service: str, command: list[str] | None = None) -> str:
        """Starts one compose service detached; returns its container name."""
        spec = SERVICES[service]
        args = ["run", "-d", "--name", self.name(service), "--network", "host"]
        if "user" in spec:
            args += ["--user", spec["user"]]
        if spec.get("read_only"):
            args.append("--read-only")
        args += [f"--cap-drop={cap}" for cap in spec.get("cap_drop", [])]
        args += [f"--security-opt={opt}" for opt in spec.get("security_opt", [])]
        args += [f"--tmpfs={path}" for path in spec.get("tmpfs", [])]
        for volume in spec.get("volumes", []):
            source, target = volume.split(":", 1)
            self.volumes.add(f"{self.project}_{source}")
            args += ["-v", f"{self.project}_{source}:{target}"]
        if "stop_grace_period" in spec:
            args += ["--stop-timeout", spec["stop_grace_period"].removesuffix("s")]
        for key, value in self.env(service).items():
            args += ["-e", f"{key}={value}"]
        args.append(expand(spec["image"]))
        args += command if command is not None else spec.get("command", [])
        self.engine(*args)
        self.started.append(self.name(service))
        return self.name(service)

    def exit_code(self, service: str, within: float = 300) -> int:
        """Waits for a container to exit and returns its status."""
        done = self.engine("wait", self.name(service), timeout=within)
        return int(done.stdout.strip().splitlines()[-1])

    def logs(self, service: str) -> str:
        done = self.engine("logs", self.name(service), check=False)
        return done.stdout + done.stderr

    def cli(self, *args: str) -> str:
        """The host's `taskgate` command against the submit and notifier containers."""
        taskgate = shutil.which("taskgate", path=str(Path(sys.executable).parent))
        assert taskgate is not None
        command = [taskgate, "--json", "--address", f"127.0.0.1:{self.ports['submit']}"]
        command += ["--events-address", f"127.0.0.1:{self.ports['notifier']}", "--api-key", self.api_key, *args]
        done = subprocess.run(command, capture_output=True, text=True, timeout=240, cwd=self.tmp)
        assert done.returncode == 0, f"{args}: {done.returncode}\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}"
        return done.stdout


def images_missing(tool: str) -> list[str]:
    wanted = [f"taskgate-api:{TAG}", f"taskgate:{TAG}"]
    wanted += [expand(SERVICES[name]["image"]) for name in ("postgres", "nats")]
    return [image for image in wanted if not image_exists(tool, image)]


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    tool = engine()
    if tool is None:
        pytest.skip(
            "no container engine (podman, or docker with a running daemon); as root with apt, `make images` installs "
            "podman"
        )
    for service, standin in STANDINS.items():
        variable = f"TASKGATE_{service.upper()}_IMAGE"
        if variable not in os.environ and image_exists(tool, standin):
            os.environ[variable] = standin  # no registry here: scripts/container_host.sh built the stand-ins
    missing = images_missing(tool)
    if missing:
        pytest.skip(f"images missing ({', '.join(missing)}): run `make images` first")
    stack = Stack(tool, f"tgimages{os.getpid()}", tmp_path_factory.mktemp("images"))
    stack.ports = {name: free_port() for name in ("postgres", "nats", "http", *GRPC, *METRICS.values())}
    try:
        yield stack
    finally:
        for name in reversed(stack.started):
            stack.engine("rm", "-f", "-t", "0", name, check=False)
        for volume in stack.volumes:
            stack.engine("volume", "rm", "-f", volume, check=False)


@pytest.mark.images
@pytest.mark.timeout(1200)
async def test_the_images_run_a_task_end_to_end_and_stop_cleanly(stack: Stack) -> None:
    pg, nats = stack.ports["postgres"], stack.ports["nats"]
    stack.run("postgres", ["postgres", "-p", str(pg), "-c", "listen_addresses=127.0.0.1"])
    stack.run("nats", [*SERVICES["nats"]["command"], "-a", "127.0.0.1", "-p", str(nats)])
    url = stack.env("migrate")["TASKGATE_DATABASE_URL"]

    async def postgres_up() -> bool:
        try:
            await (await asyncpg.connect(url, timeout=2)).close()
        except (OSError, asyncpg.PostgresError):
            return False
        return True

    await wait_for(postgres_up, within=60, every=0.5)
    for job in ("migrate", "tiny-model"):
        stack.run(job)
        assert stack.exit_code(job) == 0, stack.logs(job)
    assert "schema up to date" in stack.logs("migrate") and "streams declared" in stack.logs("migrate")

    services = [name for name in TASKGATE if name not in ("migrate", "tiny-model")]
    for service in services:
        stack.run(service)
    for service in GRPC:
        address = f"127.0.0.1:{stack.ports[service]}"
        try:
            await wait_for(lambda: serving(address), within=180, every=0.5)  # noqa: B023 - awaited before the loop moves on
        except TimeoutError:
            raise AssertionError(f"{service} not SERVING at {address}:\n{stack.logs(service)[-4000:]}") from None
    async with httpx.AsyncClient() as client:
        for process, setting in METRICS.items():
            reply = await client.get(f"http://127.0.0.1:{stack.ports[setting]}/metrics")
            assert reply.status_code == 200 and "# TYPE" in reply.text, process

    # the hardening is in force: not root, no capability even in the bounding set (a non-root user's effective set is
    # empty anyway), no privilege gain, nothing writable outside the mounts
    script = "id -u; grep -E 'CapBnd|NoNewPrivs' /proc/self/status; touch /opt/venv/x"
    probe = stack.engine("exec", stack.name("submit"), "sh", "-c", script, check=False)
    assert probe.stdout.split()[:5] == ["10001", "CapBnd:", "0000000000000000", "NoNewPrivs:", "1"], probe.stdout
    assert probe.returncode != 0 and "Read-only file system" in probe.stderr

    created = stack.engine("exec", stack.name("submit"), "taskgate-keys", "create", "--tenant", "images", "--json")
    stack.api_key = json.loads(created.stdout)["api_key"]
    lines = stack.cli(
        "submit", "a red fox in the snow", "--frames", "9", "--width", "32", "--height", "32", "--steps", "2", "--wait"
    )
    final = json.loads(lines)
    assert final["status"] == "SUCCEEDED", lines
    stack.cli("result", final["task_id"], "-o", "fox.mp4")
    with av.open(str(stack.tmp / "fox.mp4")) as video:
        frames = [frame.to_ndarray(format="rgb24") for frame in video.decode(video=0)]
    assert len(frames) == 9 and frames[0].shape == (32, 32, 3)

    # SIGTERM while the worker runs a task: it drains (the task finishes) and every process exits 0
    running = json.loads(stack.cli("submit", "a slow one", "--model", "sleepy"))["task_id"]
    await wait_for(lambda: json.loads(stack.cli("get", running))["status"] == "PROCESSING", within=60, every=0.5)
    started = time.monotonic()
    stack.engine("stop", stack.name("worker"), timeout=120)
    assert time.monotonic() - started < float(SERVICES["worker"]["stop_grace_period"].removesuffix("s"))
    assert json.loads(stack.cli("get", running))["status"] == "SUCCEEDED"
    for service in [name for name in services if name != "worker"]:
        stack.engine("stop", stack.name(service), timeout=120)
    for service in services:
        assert stack.exit_code(service, within=10) == 0, f"{service} exited uncleanly:\n{stack.logs(service)[-3000:]}"
        assert "Traceback" not in stack.logs(service), stack.logs(service)[-3000:]
