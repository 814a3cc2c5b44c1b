"""make run keeps the stack up: a service process that dies is started again with backoff, as Kubernetes would."""

from __future__ import annotations

import io
import os
import signal

import pytest

from taskgate.config import Settings
from taskgate_local.dev import Console, DevStack, _serving
from tests.support.harness import wait_for


async def test_a_killed_service_is_restarted_with_a_logged_line(
    settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TASKGATE_SUBMIT_METRICS_PORT", "0")  # the children read the environment
    out = io.StringIO()
    dev = DevStack(settings, Console(out), services=("submit",))
    try:
        await dev.start_services()
        await dev.wait_healthy()
        dev.keep_running()
        first = dev.children[0].proc
        os.killpg(first.pid, signal.SIGKILL)  # as the OOM killer would
        await first.wait()
        await wait_for(lambda: dev.children[0].proc is not first, within=30)
        assert "submit exited with code -9; restarting it in 1s (restart 1)" in out.getvalue()
        await wait_for(lambda: _serving(dev.address("submit")), within=60)
        assert dev.children[0].proc.returncode is None
    finally:
        await dev.stop()
    assert all(child.proc.returncode is not None for child in dev.children)
