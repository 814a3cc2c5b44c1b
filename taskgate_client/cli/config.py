"""Where the `taskgate` command connects: flags, then TASKGATE_* variables, then what `make run` saved."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from taskgate_client import make_config
from taskgate_client.config import DEFAULT_ADDRESS, ClientConfig
from taskgate_client.local import LocalStack, find_state_dir


def _state_dir() -> Path:
    return find_state_dir(Path(_env("TASKGATE_STATE_DIR") or ".taskgate"))


def _env(name: str) -> str | None:
    return os.environ.get(name) or None


def client_config(args: argparse.Namespace) -> ClientConfig:
    """Flags win, then TASKGATE_* variables, then the details `make run` saved, then localhost defaults."""
    saved = LocalStack.load(_state_dir())
    address = args.address or _env("TASKGATE_ADDRESS")
    use_saved = address is None and saved is not None
    if address is None:
        address = saved.address if saved is not None else DEFAULT_ADDRESS
    return make_config(
        address,
        args.api_key or _env("TASKGATE_API_KEY") or (saved.api_key if saved else None),
        events_address=args.events_address
        or _env("TASKGATE_EVENTS_ADDRESS")
        or (saved.events_address if use_saved and saved else None),
        admin_address=args.admin_address
        or _env("TASKGATE_ADMIN_ADDRESS")
        or (saved.admin_address if use_saved and saved else None),
        admin_key=args.admin_key or _env("TASKGATE_ADMIN_KEY") or (saved.admin_key if saved else None),
        tls=args.tls,
        root_certificates=args.tls_ca,
        client_cert=args.tls_cert,
        client_key=args.tls_key,
        tls_server_name=args.tls_server_name,
        call_timeout=args.timeout,
    )
