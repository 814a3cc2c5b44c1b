"""The running local stack's connection details, saved by `make run` so the CLI and scripts just work."""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

from taskgate_api import cli

CLIENT_FILE = "client.json"


@dataclass(frozen=True, slots=True)
class LocalStack:
    """Addresses and keys of a stack started by `make run` (`<state dir>/client.json`)."""

    address: str
    events_address: str
    admin_address: str
    worker_address: str
    api_key: str
    admin_key: str
    tenant: str
    webhook_secret: str | None = None
    http_address: str = ""  # the HTTP/JSON API and dashboard, e.g. http://127.0.0.1:8000

    def save(self, state_dir: Path) -> Path:
        """Writes client.json readable by its owner only (it holds keys)."""
        state_dir.mkdir(parents=True, exist_ok=True)
        path = state_dir / CLIENT_FILE
        partial = path.with_name(CLIENT_FILE + ".part")
        fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as out:
            json.dump(asdict(self), out, indent=2)
        partial.replace(path)
        return path

    @classmethod
    def load(cls, state_dir: Path) -> LocalStack | None:
        """The saved details under `state_dir`, or None if there are none (or they are unreadable)."""
        try:
            data = json.loads((state_dir / CLIENT_FILE).read_text())
            return cls(**{k: data[k] for k in cls.__dataclass_fields__ if k in data})
        except (OSError, ValueError, TypeError):
            return None


def find_state_dir(state_dir: Path, start: Path | None = None, marker: str = CLIENT_FILE) -> Path:
    """`state_dir` if absolute or holding `marker` (the saved details); else the nearest parent of `start` (cwd) where
    it does. So the CLI finds the stack's details from any subfolder of the checkout."""
    return cli.find_state_dir(state_dir, start, marker=marker)
