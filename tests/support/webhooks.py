"""A webhook receiver for tests: a tiny HTTP/1.1 server that records every request and answers as told."""

from __future__ import annotations

import asyncio
import contextlib
import json
import ssl
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Received:
    """One request a WebhookReceiver got (monotonic and wall-clock arrival, `index` in arrival order from 0), and the
    status it answered (None: hung)."""

    at: float
    wall: float
    path: str
    headers: dict[str, str]
    body: bytes
    index: int = 0
    status: int | None = None

    def json(self) -> Any:
        return json.loads(self.body)


@dataclass
class Reply:
    """How to answer one request.

    status None hangs until the client gives up; `trickle` sends the body one byte per `trickle` seconds;
    `body_bytes` sends that many bytes of body (a huge response) instead of `body`; `raw` is sent as it is
    instead of a response (garbage, or b"" to hang up at once).
    """

    status: int | None = 200
    headers: dict[str, str] = field(default_factory=dict)
    body: bytes = b"ok"
    trickle: float = 0.0
    body_bytes: int = 0
    raw: bytes | None = None


class WebhookReceiver:
    """A tiny HTTP/1.1 server on 127.0.0.1 (HTTPS as `localhost` with a `tls` context); `reply(request)` decides
    each answer. Records every request."""

    def __init__(
        self,
        reply: Callable[[Received], Reply] = lambda _r: Reply(),
        tls: ssl.SSLContext | None = None,
        host: str = "127.0.0.1",
    ) -> None:
        self.reply = reply
        self.host = host
        self.requests: list[Received] = []
        self.port = 0
        self._tls = tls
        self._server: asyncio.Server | None = None
        self._release = asyncio.Event()

    def url(self, path: str = "/hook") -> str:
        if self._tls is not None:
            return f"https://localhost:{self.port}{path}"
        return f"http://{self.host}:{self.port}{path}"

    def ids(self) -> list[str]:
        """The webhook-id of every request, in arrival order."""
        return [r.headers["webhook-id"] for r in self.requests]

    async def __aenter__(self) -> WebhookReceiver:
        self._server = await asyncio.start_server(self._handle, self.host, 0, ssl=self._tls)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *_exc: object) -> None:
        self._release.set()
        if self._server is not None:
            self._server.close()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            lines = head.decode("latin-1").split("\r\n")
            path = lines[0].split(" ")[1] if len(lines[0].split(" ")) > 1 else ""
            headers: dict[str, str] = {}
            for line in lines[1:]:
                if ":" in line:
                    name, value = line.split(":", 1)
                    headers[name.strip().lower()] = value.strip()
            body = await reader.readexactly(int(headers.get("content-length", "0")))
            request = Received(time.monotonic(), time.time(), path, headers, body, len(self.requests))
            self.requests.append(request)
            reply = self.reply(request)
            request.status = reply.status
            await self._answer(writer, reply)
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError, ValueError):
            pass
        finally:
            with contextlib.suppress(Exception):
                writer.close()

    async def _answer(self, writer: asyncio.StreamWriter, reply: Reply) -> None:
        if reply.raw is not None:
            writer.write(reply.raw)
            await writer.drain()
            return
        if reply.status is None:
            await self._release.wait()
            return
        size = reply.body_bytes or len(reply.body)
        extra = "".join(f"{k}: {v}\r\n" for k, v in reply.headers.items())
        writer.write(
            f"HTTP/1.1 {reply.status} X\r\ncontent-length: {size}\r\nconnection: close\r\n{extra}\r\n".encode()
        )
        if reply.trickle:
            for i in range(size):
                writer.write(reply.body[i : i + 1] or b"x")
                await writer.drain()
                await asyncio.sleep(reply.trickle)
            return
        if reply.body_bytes:
            chunk = b"x" * 65536
            left = reply.body_bytes
            while left > 0:
                writer.write(chunk[: min(left, len(chunk))])
                left -= len(chunk)
                await writer.drain()
            return
        writer.write(reply.body)
        await writer.drain()
