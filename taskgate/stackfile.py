"""The file a local stack writes under its state folder so service processes find its servers (`servers.json`)."""

from __future__ import annotations

import json
import os
from pathlib import Path

SERVERS_FILE = "servers.json"


def write_stack_urls(state_dir: Path, *, database_url: str, nats_url: str) -> Path:
    """Records the servers of a stack this process owns (it is trusted only while this process lives)."""
    path = state_dir / SERVERS_FILE
    path.write_text(json.dumps({"database_url": database_url, "nats_url": nats_url, "owner_pid": os.getpid()}))
    return path


def local_stack_urls(state_dir: Path) -> tuple[str, str] | None:
    """The (database, NATS) URLs of a local stack another process runs under `state_dir`, if it is alive."""
    try:
        data = json.loads((state_dir / SERVERS_FILE).read_text())
        os.kill(int(data["owner_pid"]), 0)
    except (OSError, ValueError, KeyError):
        return None
    return str(data["database_url"]), str(data["nats_url"])
