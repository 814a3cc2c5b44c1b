"""`make run`: embedded PostgreSQL + NATS, the four services as processes, and a real demo task, until Ctrl-C."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import socket
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

import grpc
import httpx
from grpc_health.v1 import health_pb2, health_pb2_grpc

from taskgate import auth, runtime
from taskgate.config import Settings, load_settings
from taskgate.sealing import Sealer
from taskgate.stackfile import local_stack_urls
from taskgate.store import admins, tenants
from taskgate_client import AsyncTaskgateClient, connect_async
from taskgate_client.errors import ResourceExhausted, TaskgateError
from taskgate_client.local import LocalStack
from taskgate_client.progress import follow
from taskgate_local import embedded, tinylm, tinymodel

SERVICES = ("submit", "notifier", "scheduler", "worker", "http")
DEMO_TENANT = "demo"
ADMIN_TENANT = "ops"
DEMO_PROMPT = "a red fox running through fresh snow at sunrise, cinematic"
COLOURS = {"submit": 36, "notifier": 35, "scheduler": 33, "worker": 32, "dev": 1}
# A service that exits is started again after these delays in turn (the last repeats), as Kubernetes restarts a pod;
# one that ran STABLE_SECONDS before exiting starts over from the first delay.
RESTART_DELAYS = (1.0, 2.0, 4.0, 8.0, 16.0, 30.0)
STABLE_SECONDS = 60.0
LEVEL_COLOURS = {"warning": 33, "error": 31, "critical": 31}


class StartError(Exception):
    """The stack could not start; the message says what to do."""


class Console:
    """Everything `make run` prints: its own lines and the services' logs, prefixed and (on a terminal) coloured."""

    def __init__(self, out: TextIO = sys.stdout) -> None:
        self.out = out
        self.colour = out.isatty() and not os.environ.get("NO_COLOR")
        self.width = max(len(s) for s in SERVICES)

    def _paint(self, code: int, text: str) -> str:
        return f"\x1b[{code}m{text}\x1b[0m" if self.colour else text

    def say(self, text: str = "") -> None:
        """A line from make run itself."""
        self.out.write((self._paint(1, text) if text else "") + "\n")
        self.out.flush()

    def log(self, service: str, raw: str) -> None:
        """One log line of a service: JSON logs become `time level message key=value`."""
        line = raw.rstrip("\n")
        try:
            record = json.loads(line)
        except ValueError:
            record = None
        if isinstance(record, dict) and "msg" in record:
            level = str(record.get("level", "info"))
            extras = " ".join(
                f"{k}={v}" for k, v in record.items() if k not in ("ts", "level", "service", "logger", "msg", "exc")
            )
            stamp = str(record.get("ts", ""))[11:23]
            text = f"{stamp} {level:<7} {record['msg']}" + (f"  {extras}" if extras else "")
            if level in LEVEL_COLOURS:
                text = self._paint(LEVEL_COLOURS[level], text)
            if record.get("exc"):
                text += "\n" + str(record["exc"])
        else:
            text = line
        prefix = self._paint(COLOURS.get(service, 0), f"{service:>{self.width}} |")
        self.out.write("".join(f"{prefix} {part}\n" for part in text.split("\n")))
        self.out.flush()


@dataclass
class Child:
    """One service process and the task that forwards its output."""

    name: str
    port: int
    proc: asyncio.subprocess.Process
    pump: asyncio.Task[None]
    tail: list[str] = field(default_factory=list)
    started: float = field(default_factory=time.monotonic)


def _ports(settings: Settings) -> dict[str, int]:
    """Each service's gRPC port; 0 (ephemeral) becomes a free port chosen now, so the others can be told it."""
    wanted = {
        "submit": settings.submit_port,
        "notifier": settings.notifier_port,
        "scheduler": settings.scheduler_port,
        "worker": settings.worker_port,
        "http": settings.http_port,
    }
    return {name: port or embedded.free_port() for name, port in wanted.items()}


def _client_host(settings: Settings) -> str:
    return "127.0.0.1" if settings.grpc_host in ("0.0.0.0", "::", "") else settings.grpc_host


def busy_ports(settings: Settings, ports: dict[str, int]) -> list[str]:
    """The gRPC and metrics ports something already listens on (the servers use SO_REUSEPORT and would share them)."""
    wanted = {f"TASKGATE_{name.upper()}_PORT": port for name, port in ports.items()}
    for name in ports:
        metrics = int(getattr(settings, f"{name}_metrics_port"))
        if metrics:
            wanted[f"TASKGATE_{name.upper()}_METRICS_PORT"] = metrics
    busy = []
    for variable, port in wanted.items():
        host = (
            settings.metrics_host
            if "METRICS" in variable
            else settings.http_host
            if "HTTP" in variable
            else settings.grpc_host
        )
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            # a connection of the previous run left in TIME_WAIT is no listener (the servers bind over it too)
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind((host, port))
            except OSError:
                busy.append(f"{port} ({variable})")
    return busy


async def _pump(console: Console, child_name: str, stream: asyncio.StreamReader, tail: list[str]) -> None:
    while True:
        raw = await stream.readline()
        if not raw:
            return
        line = raw.decode(errors="replace")
        tail.append(line)
        del tail[:-40]
        console.log(child_name, line)


async def _serving(address: str, http: bool = False) -> bool:
    """Whether a service answers its health check: gRPC Health, or the HTTP service's GET /healthz."""
    if http:
        async with httpx.AsyncClient(timeout=1.0, trust_env=False) as client:
            try:
                return (await client.get(f"http://{address}/healthz")).status_code == 200
            except httpx.HTTPError:
                return False
    async with grpc.aio.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            reply = await stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=1.0)
        except grpc.aio.AioRpcError:
            return False
        return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)


class DevStack:
    """The processes and servers `make run` owns, and their orderly shutdown."""

    def __init__(self, settings: Settings, console: Console, services: Sequence[str] = SERVICES) -> None:
        self.settings = settings
        self.services = tuple(services)
        self.console = console
        self.state_dir = settings.state_dir.resolve()
        self.ports = _ports(settings)
        self.host = _client_host(settings)
        self.stack: embedded.EmbeddedStack | None = None
        self._starting: asyncio.Future[embedded.EmbeddedStack] | None = None
        self.children: list[Child] = []
        self._keepers: list[asyncio.Task[None]] = []
        self.database_url = settings.database_url or ""
        self.nats_url = settings.nats_url or ""

    def address(self, service: str) -> str:
        return f"{self.host}:{self.ports[service]}"

    async def start_servers(self) -> None:
        """Configured URLs win; else embedded PostgreSQL + NATS under the state folder (kept between runs)."""
        if self.database_url and self.nats_url:
            self.console.say("using PostgreSQL and NATS from TASKGATE_DATABASE_URL / TASKGATE_NATS_URL")
            return
        running = local_stack_urls(self.state_dir)
        if running is not None:
            self.console.say(f"using the embedded servers already running under {self.state_dir}")
        else:
            self.console.say(f"starting embedded PostgreSQL and NATS under {self.state_dir} …")
            self.stack = embedded.EmbeddedStack(self.state_dir)
            # A Ctrl-C now must not leave servers behind: stop() waits for this thread before stopping them.
            self._starting = asyncio.ensure_future(asyncio.to_thread(self.stack.start))
            await asyncio.shield(self._starting)
            assert self.stack.postgres is not None and self.stack.nats is not None
            running = (self.stack.postgres.url, self.stack.nats.url)
        self.database_url = self.database_url or running[0]
        self.nats_url = self.nats_url or running[1]

    async def build_model(self) -> None:
        """Builds each tiny model of the registry (taskgate_local.tinymodel's names, and tinylm's chat model) whose
        folder is missing."""
        for name, spec in self.settings.models.items():
            if spec.path is None:
                continue
            folder = spec.path if spec.path.is_absolute() else Path.cwd() / spec.path
            if name == tinylm.MODEL_NAME and spec.kind == "transformers":
                if tinylm.is_lm_folder(folder):
                    continue
                command = ["-m", "taskgate_local.tinylm", "--folder", str(folder)]
            elif name in tinymodel.TINY_MODELS and spec.kind == "diffusers":
                if tinymodel.is_pipeline_folder(folder):
                    continue
                command = ["-m", "taskgate_local.tinymodel", "--model", name, "--out", str(folder)]
            else:
                continue
            self.console.say(f"building the tiny {name} model in {folder} (once) …")
            proc = await asyncio.create_subprocess_exec(
                sys.executable, *command, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
            )
            try:
                output, _ = await proc.communicate()
            except asyncio.CancelledError:
                proc.kill()
                await proc.wait()
                raise
            if proc.returncode != 0:
                raise StartError(f"building the tiny {name} model failed:\n{output.decode(errors='replace')}")

    async def prepare_database(self) -> LocalStack:
        """Migrates, then reuses the saved demo and admin keys if they still work, else creates them."""
        settings = self.settings.model_copy(update={"database_url": self.database_url, "nats_url": self.nats_url})
        backends = await runtime.connect(settings, "dev")
        try:
            pool, pepper = backends.pool, settings.api_key_pepper
            saved = LocalStack.load(self.state_dir)

            async def valid(key: str | None, tenant: str, admin: bool) -> bool:
                if not key:
                    return False
                digest = auth.hash_key(pepper, key)
                if admin:
                    held = await admins.lookup(pool, digest)
                    return held is not None and held.name == tenant and held.scope == auth.OPERATOR and not held.expired
                found = await tenants.lookup_api_key(pool, digest)
                return found is not None and found.tenant_id == tenant

            api_key = saved.api_key if saved and await valid(saved.api_key, DEMO_TENANT, False) else None
            admin_key = saved.admin_key if saved and await valid(saved.admin_key, ADMIN_TENANT, True) else None
            if api_key is None:
                api_key, _ = await auth.create_key(pool, pepper, DEMO_TENANT)
            if admin_key is None:
                admin_key, _ = await auth.create_key(pool, pepper, ADMIN_TENANT, admin=True)
            secrets = await auth.webhook_secrets(pool, DEMO_TENANT, Sealer.of(settings))
        finally:
            await backends.close()
        details = LocalStack(
            address=self.address("submit"),
            events_address=self.address("notifier"),
            admin_address=self.address("scheduler"),
            worker_address=self.address("worker"),
            http_address=f"http://{self.address('http')}",
            api_key=api_key,
            admin_key=admin_key,
            tenant=DEMO_TENANT,
            webhook_secret=secrets[0] if secrets else None,
        )
        return details

    def _child_env(self) -> dict[str, str]:
        env = dict(os.environ)
        env.update(
            {
                "TASKGATE_DATABASE_URL": self.database_url,
                "TASKGATE_NATS_URL": self.nats_url,
                "TASKGATE_STATE_DIR": str(self.state_dir),
                "TASKGATE_SUBMIT_PORT": str(self.ports["submit"]),
                "TASKGATE_NOTIFIER_PORT": str(self.ports["notifier"]),
                "TASKGATE_SCHEDULER_PORT": str(self.ports["scheduler"]),
                "TASKGATE_WORKER_PORT": str(self.ports["worker"]),
                "TASKGATE_HTTP_PORT": str(self.ports["http"]),
                "PYTHONUNBUFFERED": "1",
                "HF_HUB_DISABLE_PROGRESS_BARS": "1",
                "HF_HUB_OFFLINE": "1",
            }
        )
        if "TASKGATE_CALLBACK_ALLOW_HOSTS" not in os.environ:
            env["TASKGATE_CALLBACK_ALLOW_HOSTS"] = json.dumps(
                sorted({"127.0.0.1", "localhost", *self.settings.callback_allow_hosts})
            )
        if self.settings.models and "TASKGATE_MODELS" not in os.environ:
            # Relative model folders must mean the same thing to the services as to us.
            models = {
                name: spec.model_copy(update={"path": spec.path.resolve()}) if spec.path is not None else spec
                for name, spec in self.settings.models.items()
            }
            env["TASKGATE_MODELS"] = json.dumps({name: spec.model_dump(mode="json") for name, spec in models.items()})
        return env

    async def start_services(self) -> None:
        """Starts each service as `python -m services.<name>` in its own session (so only we get Ctrl-C)."""
        busy = busy_ports(self.settings, {name: self.ports[name] for name in self.services})
        if busy:
            raise StartError(
                f"ports in use: {', '.join(busy)}; stop what uses them, or set those variables (0 = any free port)"
            )
        for name in self.services:
            self.children.append(await self._spawn(name))

    async def _spawn(self, name: str) -> Child:
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            f"services.{name}",
            env=self._child_env(),
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
            start_new_session=True,
            limit=1024 * 1024,
        )
        assert proc.stdout is not None
        tail: list[str] = []
        pump = asyncio.create_task(_pump(self.console, name, proc.stdout, tail))
        return Child(name, self.ports[name], proc, pump, tail)

    def keep_running(self) -> None:
        """From now on a service that exits is restarted with backoff instead of stopping the stack; stop() ends it."""
        self._keepers = [
            asyncio.create_task(self._keep(index), name=f"keep-{c.name}") for index, c in enumerate(self.children)
        ]

    async def _keep(self, index: int) -> None:
        restarts = 0
        while True:
            child = self.children[index]
            code = await child.proc.wait()
            _signal_group(child.proc.pid, signal.SIGKILL)  # whatever it started goes with it
            if time.monotonic() - child.started >= STABLE_SECONDS:
                restarts = 0
            delay = RESTART_DELAYS[min(restarts, len(RESTART_DELAYS) - 1)]
            restarts += 1
            self.console.say(f"{child.name} exited with code {code}; restarting it in {delay:g}s (restart {restarts})")
            await asyncio.sleep(delay)
            spawning = asyncio.ensure_future(self._spawn(child.name))
            try:
                self.children[index] = await asyncio.shield(spawning)
            except asyncio.CancelledError:
                self.children[index] = await spawning  # started all the same: stop() stops it with the others
                raise

    async def wait_healthy(self) -> None:
        """Waits until every service answers the gRPC health check; fails fast if one exits."""
        deadline = time.monotonic() + self.settings.dev_start_timeout_seconds
        pending = {c.name: c for c in self.children}
        while pending:
            for name, child in list(pending.items()):
                if child.proc.returncode is not None:
                    raise StartError(
                        f"{name} exited with code {child.proc.returncode} while starting (its log is above)"
                    )
                if await _serving(self.address(name), http=name == "http"):
                    self.console.say(f"{name} is serving on {self.address(name)}")
                    del pending[name]
            if pending and time.monotonic() > deadline:
                raise StartError(
                    f"not healthy after {self.settings.dev_start_timeout_seconds:g}s: {', '.join(pending)}"
                )
            if pending:
                await asyncio.sleep(0.1)

    async def stop(self) -> None:
        """Ends the restarts, SIGTERMs every service, waits for them, SIGKILLs what is left, stops the embedded
        servers."""
        for keeper in self._keepers:
            keeper.cancel()
        await asyncio.gather(*self._keepers, return_exceptions=True)
        alive = [c for c in self.children if c.proc.returncode is None]
        if alive:
            self.console.say(f"stopping {', '.join(c.name for c in alive)} …")
        for child in alive:
            _signal_group(child.proc.pid, signal.SIGTERM)
        if alive:
            _, still = await asyncio.wait(
                [asyncio.create_task(c.proc.wait()) for c in alive], timeout=self.settings.dev_stop_timeout_seconds
            )
            for task in still:
                task.cancel()
        for child in self.children:
            # The whole session: also anything a service started itself.
            _signal_group(child.proc.pid, signal.SIGKILL)
            if child.proc.returncode is None:
                self.console.say(f"{child.name} did not stop in time: killed")
                await child.proc.wait()
        for child in self.children:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(child.pump, 5)
        if self._starting is not None:
            await asyncio.wait([self._starting])
        if self.stack is not None:
            self.console.say("stopping embedded PostgreSQL and NATS …")
            await asyncio.to_thread(self.stack.stop)
            self.stack = None


def _signal_group(pid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)


async def run_demo(console: Console, details: LocalStack, settings: Settings, prompt: str) -> Path:
    """Submits a real text-to-video task through the public API, shows its progress, downloads the MP4."""
    target = settings.state_dir.resolve() / "demo.mp4"
    async with connect_async(
        details.address, details.api_key, events_address=details.events_address, admin_address=details.admin_address
    ) as client:
        task = await client.submit(prompt, frames=17, width=64, height=64, steps=4, seed=42)
        console.say(f"submitted demo task {task.task_id}: {prompt!r}")
        final = await follow(client, task.task_id, console.out, settings.dev_demo_timeout_seconds)
        if final.result is None:
            raise StartError(
                f"the demo task ended {final.status.value}: {final.error_code} {final.error_message}".rstrip()
            )
        info = await client.download(task.task_id, target)
        console.say(f"demo video: {target} ({info.size_bytes} bytes, sha256 verified)")
        if tinylm.MODEL_NAME in settings.models:
            await chat_demo(client, console, settings)
    return target


async def chat_demo(client: AsyncTaskgateClient, console: Console, settings: Settings) -> None:
    """A chat task on the tiny language model (random weights: its answer is word salad), its answer printed."""
    question = "Review this diff: return value + error test"
    task = await client.chat(question, tinylm.MODEL_NAME, max_output_tokens=48, temperature=0.8, seed=7)
    console.say(f"submitted demo chat task {task.task_id}: {question!r}")
    final = await follow(client, task.task_id, console.out, settings.dev_demo_timeout_seconds)
    if final.answer is None:
        raise StartError(
            f"the demo chat task ended {final.status.value}: {final.error_code} {final.error_message}".rstrip()
        )
    console.say(f"demo chat answer ({final.output_tokens} tokens, {final.answer.finish_reason}): {final.answer.text!r}")


async def demo_beside(console: Console, details: LocalStack, settings: Settings, prompt: str) -> None:
    """The demo of a stack that stays up: whatever stops it (the demo tenant's earlier tasks still unfinished from a
    run that was stopped, a failed task, a timeout) is reported, and the stack keeps running."""
    try:
        await run_demo(console, details, settings, prompt)
    except ResourceExhausted as exc:
        console.say(
            f"the demo task was not submitted: {exc.message} (the demo tenant's tasks from an earlier run are still "
            "unfinished; `taskgate list` shows them). The stack keeps running."
        )
    except (StartError, TaskgateError, TimeoutError) as exc:
        console.say(f"the demo did not finish: {exc}. The stack keeps running.")


def next_steps(console: Console, details: LocalStack, state_dir: Path) -> None:
    """What to try next, in another terminal."""
    console.say()
    console.say("taskgate is running. In another terminal (the CLI finds this stack by itself):")
    for line in (
        '  .venv/bin/taskgate submit "a cat surfing a wave" --wait',
        "  .venv/bin/taskgate list",
        "  .venv/bin/taskgate watch <TASK_ID>",
        "  .venv/bin/taskgate cancel <TASK_ID> --hard",
        "  .venv/bin/taskgate result <TASK_ID> -o out.mp4",
        "  .venv/bin/taskgate admin stats",
        "  .venv/bin/python examples/webhook_receiver.py   # then submit with --callback-url http://127.0.0.1:8080/hook",
    ):
        console.out.write(line + "\n")
    console.say()
    console.out.write(
        f"  gateway {details.address}   events {details.events_address}   admin {details.admin_address}\n"
        f"  HTTP API {details.http_address}/v1   dashboard {details.http_address}/dashboard   OpenAPI "
        f"{details.http_address}/openapi.json\n  demo API key and admin key: {state_dir / 'client.json'}\n"
    )
    console.say("Ctrl-C stops everything.")


async def main_async(settings: Settings, *, demo_only: bool, demo: bool, prompt: str, console: Console) -> int:
    """Runs the whole local stack; returns the process exit code."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    dev = DevStack(settings, console)
    saved = LocalStack.load(dev.state_dir)
    if saved is not None and await _serving(saved.address):
        console.say(
            f"a taskgate stack is already serving on {saved.address} (from {dev.state_dir}); use it, or stop it first"
        )
        return 1
    code = 0
    try:
        work = asyncio.create_task(_start_and_demo(dev, settings, demo=demo, prompt=prompt, demo_only=demo_only))
        stopped = asyncio.create_task(stop.wait())
        done, _ = await asyncio.wait({work, stopped}, return_when=asyncio.FIRST_COMPLETED)
        if work in done:
            stopped.cancel()
            work.result()
            if not demo_only:
                await stop.wait()
        else:
            work.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await work
            console.say("interrupted")
            code = 130
    except StartError as exc:
        console.say(f"error: {exc}")
        code = 1
    except Exception as exc:
        console.say(f"error: {type(exc).__name__}: {exc}")
        code = 1
    finally:
        await dev.stop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
    console.say("stopped.")
    return code


async def _start_and_demo(dev: DevStack, settings: Settings, *, demo: bool, prompt: str, demo_only: bool) -> None:
    await asyncio.gather(dev.start_servers(), dev.build_model())
    details = await dev.prepare_database()
    await dev.start_services()
    await dev.wait_healthy()
    dev.keep_running()
    path = details.save(dev.state_dir)
    dev.console.say(f"saved connection details for the CLI in {path}")
    if demo and demo_only:
        await run_demo(dev.console, details, settings, prompt)
    elif demo:
        await demo_beside(dev.console, details, settings, prompt)
    if not demo_only:
        next_steps(dev.console, details, dev.state_dir)


def main(argv: Sequence[str] | None = None) -> int:
    """Command line of `python -m taskgate_local.dev`."""
    parser = argparse.ArgumentParser(prog="python -m taskgate_local.dev", description=__doc__)
    parser.add_argument(
        "--demo-only", action="store_true", help="exit after the demo video is saved (env TASKGATE_DEV_DEMO_ONLY)"
    )
    parser.add_argument("--no-demo", action="store_true", help="start the stack without submitting the demo task")
    parser.add_argument("--prompt", default=DEMO_PROMPT, help="the demo task's prompt")
    args = parser.parse_args(argv)
    settings = load_settings()
    console = Console()
    return asyncio.run(
        main_async(
            settings,
            demo_only=args.demo_only or settings.dev_demo_only,
            demo=not args.no_demo,
            prompt=args.prompt,
            console=console,
        )
    )


if __name__ == "__main__":
    sys.exit(main())
