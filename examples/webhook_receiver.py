"""A minimal taskgate webhook receiver: verifies each request (Standard Webhooks), ignores repeats, prints the event.

    .venv/bin/python examples/webhook_receiver.py            # listens on 127.0.0.1:8080, path /hook
    .venv/bin/taskgate submit "a cat surfing" --callback-url http://127.0.0.1:8080/hook

The signing secret comes from --secret, TASKGATE_WEBHOOK_SECRET, or the demo tenant's secret that `make run` saved in
.taskgate/client.json. Several secrets may be given (comma-separated) while a rotation is in progress.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
from collections import OrderedDict
from collections.abc import Callable
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from taskgate_client import WebhookVerificationError, verify_webhook
from taskgate_client.local import LocalStack, find_state_dir

MAX_BODY = 1024 * 1024
Event = dict[str, Any]


class Seen:
    """The most recent webhook ids: a retried delivery carries the same id and must be handled only once."""

    def __init__(self, size: int = 10_000) -> None:
        self._ids: OrderedDict[str, None] = OrderedDict()
        self._size = size
        self._lock = threading.Lock()

    def first_time(self, webhook_id: str) -> bool:
        with self._lock:
            if webhook_id in self._ids:
                return False
            self._ids[webhook_id] = None
            if len(self._ids) > self._size:
                self._ids.popitem(last=False)
            return True


def make_server(
    host: str, port: int, secrets: list[str], on_event: Callable[[Event], None], path: str = "/hook"
) -> ThreadingHTTPServer:
    """An HTTP server that answers 204 to verified webhooks on `path` (401 to anything else) and calls `on_event` once
    per id."""
    seen = Seen()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            if self.path != path:
                self.send_error(HTTPStatus.NOT_FOUND)
                return
            length = int(self.headers.get("content-length") or 0)
            if length > MAX_BODY:
                self.send_error(HTTPStatus.REQUEST_ENTITY_TOO_LARGE)
                return
            body = self.rfile.read(length)
            try:
                # Verify the raw bytes as received: re-serialised JSON would not match the signature.
                event = verify_webhook(dict(self.headers.items()), body, secrets)
            except WebhookVerificationError as exc:
                self.send_error(HTTPStatus.UNAUTHORIZED, str(exc))
                return
            # Answer fast; slow work belongs in a queue of your own.
            if seen.first_time(self.headers["webhook-id"]):
                on_event(event)
            self.send_response(HTTPStatus.NO_CONTENT)
            self.end_headers()

        def log_message(self, format: str, *args: Any) -> None:
            return

    return ThreadingHTTPServer((host, port), Handler)


def print_event(event: Event) -> None:
    """One line per webhook."""
    data = event.get("data", {})
    line = f"{event.get('type')}: task {data.get('task_id')} {data.get('status')} (version {data.get('version')})"
    if data.get("result"):
        line += f" result {data['result']['size']} bytes sha256 {data['result']['sha256'][:16]}…"
    if data.get("error"):
        line += f" error {data['error']['code']}: {data['error']['message']}"
    print(line, flush=True)


def _secrets(given: str | None) -> list[str]:
    text = given or os.environ.get("TASKGATE_WEBHOOK_SECRET")
    if not text:
        state = find_state_dir(Path(os.environ.get("TASKGATE_STATE_DIR") or ".taskgate"))
        saved = LocalStack.load(state)
        text = saved.webhook_secret if saved else None
    if not text:
        sys.exit("no webhook secret: pass --secret whsec_... or set TASKGATE_WEBHOOK_SECRET (or run `make run` first)")
    return [s.strip() for s in text.split(",") if s.strip()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8080)
    parser.add_argument("--path", default="/hook")
    parser.add_argument("--secret", help="whsec_... (comma-separated during a rotation)")
    parser.add_argument("--json", action="store_true", help="print each event as one JSON line")
    args = parser.parse_args()
    show = (lambda e: print(json.dumps(e), flush=True)) if args.json else print_event
    server = make_server(args.host, args.port, _secrets(args.secret), show, args.path)
    # SIGTERM (e.g. from a process manager) stops as cleanly as Ctrl-C does.
    signal.signal(signal.SIGTERM, lambda *_: threading.Thread(target=server.shutdown).start())
    print(f"listening on http://{args.host}:{server.server_port}{args.path}", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()


if __name__ == "__main__":
    main()
