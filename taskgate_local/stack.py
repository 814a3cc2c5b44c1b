"""`python -m taskgate_local.stack`: runs embedded PostgreSQL and NATS under the state folder until stopped."""

from __future__ import annotations

import signal
import sys
import threading

from taskgate.config import load_settings
from taskgate.stackfile import local_stack_urls
from taskgate_local.embedded import EmbeddedStack


def main() -> None:
    settings = load_settings()
    if local_stack_urls(settings.state_dir) is not None:
        sys.stderr.write(f"taskgate: an embedded stack already runs under {settings.state_dir}\n")
        raise SystemExit(1)
    stack = EmbeddedStack(settings.state_dir.resolve()).start()
    assert stack.postgres is not None and stack.nats is not None
    print(f"TASKGATE_DATABASE_URL={stack.postgres.url}", flush=True)
    print(f"TASKGATE_NATS_URL={stack.nats.url}", flush=True)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    try:
        stop.wait()
    finally:
        stack.stop()


if __name__ == "__main__":
    main()
