"""`make run`'s path as a real process tree: embedded servers, tiny model, four services, a real MP4, clean exit."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import av
import httpx
import psutil
import pytest

from taskgate.config import Settings
from taskgate.runtime import Backends
from taskgate_client.local import LocalStack
from tests.support import factories

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]  # its own waits allow a slow first build

READY = "Ctrl-C stops everything."


def dev_env(state: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TASKGATE_")}
    env.update({"TASKGATE_STATE_DIR": str(state), "NO_COLOR": "1"})
    for name in ("SUBMIT", "NOTIFIER", "SCHEDULER", "WORKER"):
        env[f"TASKGATE_{name}_PORT"] = "0"  # free ports, chosen by make run
        env[f"TASKGATE_{name}_METRICS_PORT"] = "0"
    return env


class Tree:
    """Every process a run started: its descendants (sampled while it runs) and anything using its state folder."""

    def __init__(self, root: subprocess.Popen[str], state: Path) -> None:
        self.root = root
        self.state = str(state)
        self.seen: dict[int, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        while not self._stop.is_set():
            for proc in self._ours():
                self.seen.setdefault(proc.pid, proc.create_time())
            self._stop.wait(0.1)

    def _ours(self) -> list[psutil.Process]:
        found: list[psutil.Process] = []
        with contextlib.suppress(psutil.NoSuchProcess):
            found += psutil.Process(self.root.pid).children(recursive=True)
        for proc in psutil.process_iter(["cmdline"]):
            if any(self.state in part for part in proc.info["cmdline"] or []):
                found.append(proc)
        return found

    def finish(self) -> None:
        self._stop.set()
        self._thread.join()

    def leftovers(self) -> list[str]:
        alive = []
        for pid, created in self.seen.items():
            try:
                proc = psutil.Process(pid)
                if proc.create_time() == created and proc.status() != psutil.STATUS_ZOMBIE:
                    alive.append(f"{pid} {' '.join(proc.cmdline())}")
            except psutil.NoSuchProcess:
                continue
        alive += [f"{p.pid} {' '.join(p.cmdline())}" for p in self._ours() if p.pid not in self.seen]
        return alive


def read_lines(proc: subprocess.Popen[str], into: list[str], ready: threading.Event) -> None:
    assert proc.stdout is not None
    for line in proc.stdout:
        into.append(line)
        if READY in line:
            ready.set()
    ready.set()


def frames_of(path: Path) -> tuple[int, int, int]:
    with av.open(str(path)) as container:
        frames = list(container.decode(video=0))
    return len(frames), frames[0].width, frames[0].height


def test_make_run_demo_then_a_second_run_reuses_the_state_and_stops_on_ctrl_c(tmp_path: Path) -> None:
    tmp_path.chmod(0o755)  # the embedded PostgreSQL runs as its own user when we are root
    state = tmp_path / "state"

    # First run: nothing exists yet. --demo-only: exit after the video is saved.
    first = subprocess.Popen(
        [sys.executable, "-m", "taskgate_local.dev", "--demo-only"],
        env=dev_env(state), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    tree = Tree(first, state)
    try:
        out, _ = first.communicate(timeout=420)
    finally:
        first.kill()
        tree.finish()
    assert first.returncode == 0, out
    assert len(tree.seen) >= 6, tree.seen  # four services, PostgreSQL, NATS (and their helpers) were watched
    assert "building the tiny wan-tiny model" in out
    assert "building the tiny ltx-i2v-tiny model" in out  # image-to-video beside text-to-video
    assert "building the tiny llama-tiny model" in out  # and the chat model
    assert "demo chat answer (" in out  # a chat task on it, its answer printed
    for name in ("submit", "notifier", "scheduler", "worker", "http"):
        assert f"{name} is serving on 127.0.0.1:" in out
        assert any(line.lstrip().startswith(f"{name} |") for line in out.splitlines()), f"no {name} log lines"
    assert "PROCESSING [" in out and "SUCCEEDED  [" in out  # the live progress
    video = state / "demo.mp4"
    assert f"demo video: {video}" in out
    assert frames_of(video) == (17, 64, 64)
    assert tree.leftovers() == []
    saved = LocalStack.load(state)
    assert saved is not None and saved.api_key.startswith("tg_") and saved.webhook_secret
    model_built_at = (state / "models" / "wan-tiny" / "model_index.json").stat().st_mtime_ns
    video.unlink()

    # Second run: same folder, stays up until Ctrl-C; the CLI finds it through client.json.
    second = subprocess.Popen(
        [sys.executable, "-m", "taskgate_local.dev"],
        env=dev_env(state), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    tree = Tree(second, state)
    lines: list[str] = []
    ready = threading.Event()
    reader = threading.Thread(target=read_lines, args=(second, lines, ready), daemon=True)
    reader.start()
    try:
        assert ready.wait(420) and second.poll() is None, "".join(lines)
        again = LocalStack.load(state)
        assert again is not None and (again.api_key, again.admin_key) == (saved.api_key, saved.admin_key)
        cli = Path(sys.executable).parent / "taskgate"  # the installed entry point
        listed = subprocess.run(
            [str(cli), "list", "--json"], env=dev_env(state), capture_output=True, text=True, timeout=60, cwd=tmp_path
        )
        assert listed.returncode == 0, listed.stderr
        tasks = json.loads(listed.stdout)["tasks"]
        # both runs' demo tasks (a video and a chat each), one database
        assert [t["status"] for t in tasks] == ["SUCCEEDED"] * 4
        assert sorted(t["task_type"] for t in tasks) == ["chat", "chat", "text-to-video", "text-to-video"]
        # the HTTP face of the same stack, at the address client.json names: submit, then follow it over SSE
        assert again.http_address.startswith("http://127.0.0.1:")
        auth = {"authorization": f"Bearer {again.api_key}"}
        made = httpx.post(f"{again.http_address}/v1/tasks", headers=auth, json={"prompt": "over http"}, timeout=30)
        assert made.status_code == 201, made.text
        with httpx.stream(
            "GET", f"{again.http_address}/v1/tasks/{made.json()['task']['id']}/events", headers=auth, timeout=120
        ) as sse:
            data = [json.loads(line[5:]) for line in sse.iter_lines() if line.startswith("data:")]
        last = data[-1].get("to_status") or data[-1]["task"]["status"]  # a snapshot alone if it finished first
        assert last == "TASK_STATUS_SUCCEEDED", data
        second.send_signal(signal.SIGINT)
        second.wait(120)
    finally:
        second.kill()
        reader.join(10)
        tree.finish()
    out = "".join(lines)
    assert second.returncode == 0, out
    assert "building the tiny" not in out
    assert (state / "models" / "wan-tiny" / "model_index.json").stat().st_mtime_ns == model_built_at
    assert frames_of(video) == (17, 64, 64)
    assert out.rstrip().endswith("stopped.")
    assert tree.leftovers() == []


async def test_make_run_keeps_the_stack_up_when_the_demo_tenant_still_holds_unfinished_tasks(
    tmp_path: Path, settings: Settings, backends: Backends
) -> None:
    """Runs stopped with tasks unfinished leave the demo tenant at its pending limit: the demo is refused, make run
    says so and keeps serving (it used to stop every service and exit 1)."""
    for _ in range(settings.max_pending_per_tenant):
        task = await factories.insert_task(backends.pool, user_id="demo")
        await factories.claimed(backends.pool, task.id, worker_id="gone", lease_seconds=3600)  # a run stopped mid-task
    env = dev_env(tmp_path / "state")
    env.update({"TASKGATE_DATABASE_URL": settings.database_url or "", "TASKGATE_NATS_URL": settings.nats_url or "",
                "TASKGATE_HTTP_PORT": "0", "TASKGATE_HTTP_METRICS_PORT": "0"})
    await asyncio.to_thread(run_with_a_refused_demo, tmp_path, env, settings.max_pending_per_tenant)


def run_with_a_refused_demo(tmp_path: Path, env: dict[str, str], limit: int) -> None:
    tmp_path.chmod(0o755)
    run = subprocess.Popen(
        [sys.executable, "-m", "taskgate_local.dev"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    lines: list[str] = []
    ready = threading.Event()
    reader = threading.Thread(target=read_lines, args=(run, lines, ready), daemon=True)
    reader.start()
    try:
        assert ready.wait(420) and run.poll() is None, "".join(lines)
        out = "".join(lines)
        assert f"the demo task was not submitted: at most {limit} unfinished tasks per tenant" in out, out
        assert "The stack keeps running." in out
        saved = LocalStack.load(tmp_path / "state")
        assert saved is not None
        made = httpx.post(f"{saved.http_address}/v1/tasks", headers={"authorization": f"Bearer {saved.api_key}"},
                          json={"prompt": "still serving"}, timeout=30)
        assert made.status_code == 429, made.text  # the gateway answers: the stack is up, the tenant still full
        run.send_signal(signal.SIGINT)
        run.wait(120)
    finally:
        run.kill()
        reader.join(10)
    out = "".join(lines)
    assert run.returncode == 0, out
    assert out.rstrip().endswith("stopped.")
