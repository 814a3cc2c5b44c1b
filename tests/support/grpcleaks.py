"""Finds grpc.aio servers a test left running: each is named at the teardown of the test whose event loop it outlived.

Why it matters: every grpc.aio server keeps requests for calls open on grpc.aio's one completion queue. When the last
grpc.aio object of the process is freed (at the latest at exit, by pytest's final garbage collection), grpc shuts that
queue down and joins its poller thread, and the queue's shutdown waits for those requests, which only the server's own
shutdown completes. A server whose event loop is closed can no longer be shut down, so the process hangs there for
ever (seen on tests/integration/http/test_http.py: a notifier restarted by a test was never stopped). grpc's
`Server.__del__` schedules a shutdown on the server's loop, which is too late once that loop is closed.
"""

from __future__ import annotations

import traceback
from collections.abc import Callable
from typing import Any

import grpc
import grpc.aio

_started: list[tuple[Any, str]] = []  # (server, where it was created), servers not known to be stopped yet


def _creation_site() -> str:
    """The innermost frames of the project's own code that created a server."""
    frames = [
        f
        for f in traceback.extract_stack()[:-2]
        if "/site-packages/" not in f.filename and "/_pytest/" not in f.filename
    ]
    return " <- ".join(f"{'/'.join(f.filename.rsplit('/', 2)[-2:])}:{f.lineno} {f.name}" for f in reversed(frames[-3:]))


def install() -> None:
    """Wraps grpc.aio.server so that every server made from now on is followed (the project calls it as
    grpc.aio.server)."""
    real: Callable[..., Any] = grpc.aio.server
    if getattr(real, "_taskgate_tracked", False):
        return

    def server(*args: Any, **kwargs: Any) -> Any:
        made = real(*args, **kwargs)
        _started.append((made, _creation_site()))
        return made

    server._taskgate_tracked = True  # type: ignore[attr-defined]
    grpc.aio.server = server


def leaked() -> list[str]:
    """The servers still running whose event loop has closed (never to be stopped), by creation site; stopped ones and
    those whose loop still runs (a module's stack) are forgotten or kept."""
    found: list[str] = []
    keep: list[tuple[Any, str]] = []
    for made, where in _started:
        if not made._server.is_running():
            continue
        if made._loop.is_closed():
            found.append(where)
        else:
            keep.append((made, where))
    _started[:] = keep
    return found
