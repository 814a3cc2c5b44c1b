"""A real OpenAI-compatible server for the upstream backend's tests: llama.cpp's, from llama-cpp-python[server] (the
`upstream-server` extra, compiled from source by pip), serving a GGUF made offline from the tiny chat model."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from taskgate_local.embedded import free_port

START_SECONDS = 120.0
STOP_GRACE_SECONDS = 5.0


def missing() -> str | None:
    """Why no server can be started here, or None when one can."""
    if importlib.util.find_spec("llama_cpp") is None:
        return (
            "llama-cpp-python is not installed: the `upstream-server` extra (`make upstream-server` builds it from "
            "source with cmake and a C++ compiler)"
        )
    for module in ("fastapi", "sse_starlette", "starlette_context", "gguf"):
        if importlib.util.find_spec(module) is None:
            return f"{module} is missing: install the `upstream-server` extra (llama-cpp-python[server] and gguf)"
    return None


@dataclass
class LlamaServer:
    """`python -m llama_cpp.server` on 127.0.0.1 with one model under `alias`, requests served one at a time to the end
    (--interrupt_requests off: by default a new request would cut the stream in progress short)."""

    base: Path
    model: Path
    alias: str
    api_key: str | None = None
    port: int = 0
    _proc: subprocess.Popen[bytes] | None = None

    @property
    def base_url(self) -> str:
        """The API root an OpenAI client is given."""
        return f"http://127.0.0.1:{self.port}/v1"

    @property
    def log(self) -> Path:
        return self.base / "llama-server.log"

    def start(self) -> LlamaServer:
        """Starts the server and waits until it lists its model."""
        self.base.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        args = [
            sys.executable, "-m", "llama_cpp.server", "--model", str(self.model), "--model_alias", self.alias,
            "--host", "127.0.0.1", "--port", str(self.port), "--n_ctx", "2048", "--n_threads", "1",
            "--interrupt_requests", "False", "--verbose", "False",
        ]
        if self.api_key is not None:
            args += ["--api_key", self.api_key]
        out = self.log.open("wb")
        # unbuffered: the tests read its log (the line it prints as a client leaves) while it runs
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self._proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, env=env)
        out.close()
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        deadline = time.monotonic() + START_SECONDS
        while True:  # polling a process that starts in seconds: there is nothing to wait on instead
            if self._proc.poll() is not None:
                raise RuntimeError(f"llama_cpp.server exited with {self._proc.returncode}; see {self.log}")
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(f"{self.base_url}/models", headers=headers, timeout=1).status_code == 200:
                    return self
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"llama_cpp.server did not answer within {START_SECONDS}s; see {self.log}")
            time.sleep(0.1)

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after a grace."""
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

