"""The operator dashboard at /dashboard: live queue depth, workers and running tasks, failures, dead letters and
failing webhooks, with replay, redeliver and drain behind a confirmation (shown to an operator key only: a read-only
admin key sees the same figures and no control).

It is TaskAdmin seen from a browser: every figure is a TaskAdmin call made with the operator's own admin key (the
scheduler checks it on each call, so a revoked key ends the session at the next refresh), and every action is the
RPC `taskgate admin` would send. The key lives only in this process's memory, behind an opaque session cookie
(HttpOnly, SameSite=Strict, Secure over https); actions also need the session's CSRF token, a JSON body and a
same-origin Origin. Pages are rendered on the server (services/http/dashboard_page.py) from what one round of calls
reads (services/http/dashboard_view.py); the page's small script
polls /dashboard/state.json once a second and swaps in the sections that changed.

Sessions are per process: behind several HTTP replicas, route /dashboard to one (or sign in again after a switch).
"""

from __future__ import annotations

import hmac
import logging
import secrets
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qs, urlsplit

import grpc
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, RedirectResponse, Response
from starlette.routing import BaseRoute, Route

from taskgate import auth, channels
from taskgate.config import HttpSettings
from taskgate_api.v1 import admin_pb2, worker_pb2, worker_pb2_grpc

from . import dashboard_page
from .dashboard_view import View, read_view
from .inputs import BadInput, integer, json_body
from .upstream import Upstream

log = logging.getLogger("taskgate.http.dashboard")

COOKIE = "taskgate_dashboard"
SESSION_SECONDS = 8 * 3600  # a session ends this long after sign-in, however busy
IDLE_SECONDS = 3600  # ... or after this long without a request (an open page refreshes every second)
MAX_SESSIONS = 1000  # the oldest go first past it (only admin keys make sessions)
FORM_CAP = 8 * 1024  # bytes of a sign-in or sign-out form, or an action's JSON body
KEY_CHARS = 512

_SIGNED_OUT = {
    grpc.StatusCode.UNAUTHENTICATED: "The admin key is no longer valid (revoked or unknown); sign in again.",
    grpc.StatusCode.PERMISSION_DENIED: "That key is not an admin key: the dashboard needs one.",
}


# ---------------------------------------------------------------- sessions


@dataclass
class Session:
    """A signed-in operator: the admin key every call of theirs carries, and the token their actions must echo.
    `operator`: the key's scope allows acting (replay, redeliver, drain); a read-only key's session only looks."""

    key: str
    csrf: str
    started: float
    seen: float
    operator: bool = False


class Sessions:
    """The signed-in operators of this process, by an unguessable cookie value; nothing is written anywhere."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._by_id: dict[str, Session] = {}
        self._clock = clock

    def open(self, key: str, *, operator: bool = False) -> tuple[str, Session]:
        now = self._clock()
        self._prune(now)
        while len(self._by_id) >= MAX_SESSIONS:
            del self._by_id[min(self._by_id, key=lambda sid: self._by_id[sid].seen)]
        sid = secrets.token_urlsafe(32)
        session = Session(key=key, csrf=secrets.token_urlsafe(32), started=now, seen=now, operator=operator)
        self._by_id[sid] = session
        return sid, session

    def get(self, sid: str | None) -> Session | None:
        """The live session of a cookie value (its idle clock restarted), or None."""
        session = self._by_id.get(sid) if sid else None
        if session is None or sid is None:
            return None
        now = self._clock()
        if now - session.started > SESSION_SECONDS or now - session.seen > IDLE_SECONDS:
            del self._by_id[sid]
            return None
        session.seen = now
        return session

    def close(self, sid: str | None) -> None:
        if sid:
            self._by_id.pop(sid, None)

    def _prune(self, now: float) -> None:
        for sid in [
            s for s, v in self._by_id.items() if now - v.started > SESSION_SECONDS or now - v.seen > IDLE_SECONDS
        ]:
            del self._by_id[sid]



# ---------------------------------------------------------------- the routes


class Refused(Exception):
    """A request the dashboard answers with `response` instead of going on."""

    def __init__(self, response: Response) -> None:
        super().__init__(response.status_code)
        self.response = response


def _is_key(value: str) -> bool:
    """Could be an API key: what gRPC metadata can carry (printable ASCII), of a sane length."""
    return 0 < len(value) <= KEY_CHARS and value.isascii() and value.isprintable()


def _is_task_id(value: object) -> bool:
    """A task id as the gateway spells one: ASCII digits, within int64."""
    try:
        return isinstance(value, str) and integer(value, "task_id") >= 0
    except BadInput:
        return False


async def _body(request: Request) -> bytes:
    received = bytearray()
    async for chunk in request.stream():
        received += chunk
        if len(received) > FORM_CAP:
            raise Refused(JSONResponse({"ok": False, "message": "request body too large"}, status_code=413))
    return bytes(received)


def _form(raw: bytes) -> dict[str, str]:
    """An application/x-www-form-urlencoded body, first value of each field (no multipart: nothing here uploads)."""
    return {k: v[0] for k, v in parse_qs(raw.decode("utf-8", "replace"), keep_blank_values=True).items()}


class Dashboard:
    """The dashboard's routes over the upstream TaskAdmin channel."""

    def __init__(self, upstream: Upstream, settings: HttpSettings) -> None:
        self.upstream = upstream
        self.settings = settings
        self.sessions = Sessions()
        self.env = dashboard_page.environment()
        # the models whose runs make preview images (the registry is the services' common configuration)
        self.env.globals["previews"] = frozenset(
            m
            for m, spec in settings.models.items()
            if spec.preview_every_fraction > 0 or spec.preview_every_seconds > 0
        )

    def routes(self) -> list[BaseRoute]:
        return [
            Route("/dashboard", self.page, methods=["GET"]),
            Route("/dashboard/login", self.login, methods=["POST"]),
            Route("/dashboard/login", self.to_page, methods=["GET"]),
            Route("/dashboard/logout", self.logout, methods=["POST"]),
            Route("/dashboard/state.json", self.state, methods=["GET"]),
            Route("/dashboard/tasks/{task_id}/preview", self.preview, methods=["GET"]),
            Route("/dashboard/actions/{action}", self.action, methods=["POST"]),
        ]

    # -- plumbing ------------------------------------------------------------------------------------------------

    def _metadata(self, key: str) -> list[tuple[str, str]]:
        return [("authorization", f"Bearer {key}")]

    def _html(self, template: str, status: int = 200, **context: Any) -> HTMLResponse:
        """A rendered page with the headers every dashboard page has: a CSP with this response's nonce, no caching,
        no framing, no referrer sent to other sites."""
        nonce = secrets.token_urlsafe(16)
        body = self.env.get_template(template).render(nonce=nonce, **context)
        response = HTMLResponse(body, status_code=status)
        response.headers.update({
            "content-security-policy": (
                f"default-src 'none'; script-src 'nonce-{nonce}'; style-src 'nonce-{nonce}'; connect-src 'self'; "
                "img-src 'self' data:; form-action 'self'; frame-ancestors 'none'; base-uri 'none'"
            ),
            "cache-control": "no-store",
            "x-content-type-options": "nosniff",
            "x-frame-options": "DENY",
            "referrer-policy": "same-origin",  # no-referrer would make the browser send Origin: null
        })
        return response

    def _login_form(self, reason: str = "", status: int = 200) -> HTMLResponse:
        return self._html("login.html", status, reason=reason, hours=SESSION_SECONDS // 3600)

    def _json(self, body: dict[str, Any], status: int = 200) -> JSONResponse:
        return JSONResponse(
            body, status_code=status, headers={"cache-control": "no-store", "x-content-type-options": "nosniff"}
        )

    @staticmethod
    def _same_origin(request: Request) -> bool:
        """No Origin (an older client), or the Origin of this very host: a cross-site POST never passes."""
        origin = request.headers.get("origin")
        if origin is None:
            return True
        parts = urlsplit(origin)
        return bool(parts.netloc) and parts.netloc == request.headers.get("host", "")

    def _session(self, request: Request) -> tuple[str | None, Session | None]:
        sid = request.cookies.get(COOKIE)
        return sid, self.sessions.get(sid)

    def _secure(self, request: Request) -> bool:
        # a proxy's claim of https can only add the Secure flag, never take it away: trusting it costs nothing
        return request.url.scheme == "https" or request.headers.get("x-forwarded-proto", "").lower() == "https"

    async def _read(self, session: Session) -> View:
        return await read_view(self.upstream.admin, self._metadata(session.key), self.upstream.timeout)

    # -- pages ---------------------------------------------------------------------------------------------------

    async def to_page(self, _request: Request) -> Response:
        return RedirectResponse("/dashboard", status_code=303)

    async def page(self, request: Request) -> Response:
        """The dashboard, rendered whole (it works without the script, a reload at a time); the sign-in form without a
        live session."""
        sid, session = self._session(request)
        if session is None:
            return self._login_form()
        try:
            view = await self._read(session)
        except grpc.aio.AioRpcError as exc:
            if exc.code() in _SIGNED_OUT:
                self.sessions.close(sid)
                return self._login_form(_SIGNED_OUT[exc.code()], status=401)
            return self._login_form(
                f"The scheduler did not answer ({exc.code().name}): {exc.details() or ''}", status=503
            )
        return self._html("page.html", view=view, csrf=session.csrf, problem="", operator=session.operator)

    async def login(self, request: Request) -> Response:
        """Checks the key with a GetStats call (TaskAdmin's own check: an admin key, not revoked) and opens a
        session."""
        if not self._same_origin(request):
            return self._login_form("Sign in from the dashboard's own page.", status=403)
        try:
            key = _form(await _body(request)).get("key", "").strip()
        except Refused:
            return self._login_form("That is not an API key.", status=400)
        if not _is_key(key):
            return self._login_form("That is not an API key.", status=400)
        try:
            await self.upstream.admin.GetStats(
                admin_pb2.GetStatsRequest(), metadata=self._metadata(key), timeout=self.upstream.timeout
            )
        except grpc.aio.AioRpcError as exc:
            if exc.code() is grpc.StatusCode.UNAUTHENTICATED:
                return self._login_form("That key is not valid (unknown or revoked).", status=401)
            if exc.code() is grpc.StatusCode.PERMISSION_DENIED:
                return self._login_form(_SIGNED_OUT[exc.code()], status=403)
            return self._login_form(f"The scheduler did not answer ({exc.code().name}); try again.", status=503)
        operator = await self._is_operator(key)
        self.sessions.close(request.cookies.get(COOKIE))  # a fresh session id at each sign-in (no fixation)
        sid, _session = self.sessions.open(key, operator=operator)
        # the prefix `taskgate admin keys` lists
        log.info("dashboard sign-in", extra={"key_prefix": key[:10], "scope": auth.OPERATOR if operator else auth.READ})
        response = RedirectResponse("/dashboard", status_code=303)
        response.set_cookie(
            COOKIE,
            sid,
            max_age=SESSION_SECONDS,
            path="/dashboard",
            httponly=True,
            samesite="strict",
            secure=self._secure(request),
        )
        return response

    async def _is_operator(self, key: str) -> bool:
        """Whether `key` (an admin key the scheduler just accepted) has the operator scope, read as TaskAdmin lists it:
        Authorize names the credential, ListApiKeys gives its scope (both read-only calls, nothing audited). Anything
        short of a live operator credential with this key's prefix reads as read-only: the page then offers no control,
        and the scheduler would refuse one anyway."""
        metadata = self._metadata(key)
        try:
            who = await self.upstream.admin.Authorize(
                admin_pb2.AuthorizeRequest(action="worker.status"), metadata=metadata, timeout=self.upstream.timeout
            )
            listed = await self.upstream.admin.ListApiKeys(
                admin_pb2.ListApiKeysRequest(tenant=who.admin), metadata=metadata, timeout=self.upstream.timeout
            )
        except grpc.aio.AioRpcError as exc:
            log.warning(
                "dashboard: the key's scope could not be read; signed in read-only", extra={"code": exc.code().name}
            )
            return False
        return any(
            k.admin and k.prefix == key[: len(k.prefix)] and not k.HasField("revoked_at") and k.scope == auth.OPERATOR
            for k in listed.keys
        )

    async def logout(self, request: Request) -> Response:
        sid, session = self._session(request)
        if session is not None:
            try:
                token = _form(await _body(request)).get("csrf", "")
            except Refused as refused:
                return refused.response
            if not self._same_origin(request) or not hmac.compare_digest(token, session.csrf):
                return self._login_form("Sign out from the dashboard's own page.", status=403)
            self.sessions.close(sid)
        response = RedirectResponse("/dashboard", status_code=303)
        response.delete_cookie(
            COOKIE, path="/dashboard", httponly=True, samesite="strict", secure=self._secure(request)
        )
        return response

    async def state(self, request: Request) -> Response:
        """Every live section's HTML, for the page's script; 401 once the session is gone (the script reloads)."""
        sid, session = self._session(request)
        if session is None:
            return self._json({"error": "not signed in"}, 401)
        try:
            view = await self._read(session)
        except grpc.aio.AioRpcError as exc:
            if exc.code() in _SIGNED_OUT:
                self.sessions.close(sid)
                return self._json({"error": _SIGNED_OUT[exc.code()]}, 401)
            return self._json(
                {"error": f"The scheduler did not answer ({exc.code().name}): {exc.details() or ''}"}, 503
            )
        sections = {
            name: self.env.get_template(f"{name}.html").render(view=view, operator=session.operator)
            for name in dashboard_page.SECTIONS
        }
        return self._json(
            {"sections": sections, "updated": dashboard_page.clock(view.at), "updated_at": dashboard_page.iso(view.at)}
        )

    async def preview(self, request: Request) -> Response:
        """The newest preview image of a task (TaskAdmin.GetTaskPreview), for the running tasks' table; 404 without."""
        _, session = self._session(request)
        if session is None:
            return self._json({"error": "not signed in"}, 401)
        task_id = request.path_params["task_id"]
        if not _is_task_id(task_id):
            return self._json({"error": "not a task id"}, 404)
        try:
            got = await self.upstream.admin.GetTaskPreview(
                admin_pb2.GetTaskPreviewRequest(task_id=task_id),
                metadata=self._metadata(session.key),
                timeout=self.upstream.timeout,
            )
        except grpc.aio.AioRpcError as exc:
            return self._json(
                {"error": exc.details() or exc.code().name}, 404 if exc.code() is grpc.StatusCode.NOT_FOUND else 502
            )
        return Response(got.data, media_type=got.content_type or "application/octet-stream",
                        headers={"cache-control": "private, max-age=60", "x-content-type-options": "nosniff"})

    # -- actions -------------------------------------------------------------------------------------------------

    async def action(self, request: Request) -> Response:
        """replay (a FAILED or TIMEOUT task as a new task) or redeliver (a task's webhooks); JSON {"task_id"} in,
        {"ok", "message"} out. Needs the session, its CSRF token, a JSON body and a same-origin request."""
        sid, session = self._session(request)
        if session is None:
            return self._json({"ok": False, "message": "not signed in"}, 401)
        token = request.headers.get("x-csrf-token", "")
        if not self._same_origin(request) or not hmac.compare_digest(token.encode(), session.csrf.encode()):
            return self._json({"ok": False, "message": "missing or wrong CSRF token: reload the dashboard"}, 403)
        if request.headers.get("content-type", "").split(";")[0].strip().lower() != "application/json":
            return self._json({"ok": False, "message": "send JSON"}, 415)
        if not session.operator:
            return self._json(
                {"ok": False, "message": "this admin key is read-only: acting needs an operator key"}, 403
            )
        actions: dict[str, tuple[Callable[[Session, str], Awaitable[tuple[bool, str]]], str]] = {
            "replay": (self._replay, "task_id"),
            "redeliver": (self._redeliver, "task_id"),
            "drain": (self._drain, "worker_id"),
        }
        if request.path_params["action"] not in actions:
            return self._json({"ok": False, "message": "no such action"}, 404)
        handler, field_name = actions[request.path_params["action"]]
        try:
            body = json_body(await _body(request), self.settings.http_json_max_depth)
        except Refused as refused:
            return refused.response
        except BadInput as exc:
            return self._json({"ok": False, "message": f"{exc.field}: {exc.description}"}, 400)
        target = body.get(field_name) if isinstance(body, dict) else None
        if field_name == "task_id" and not _is_task_id(target):
            return self._json({"ok": False, "message": "task_id: a task id (decimal digits) is required"}, 400)
        if field_name == "worker_id" and (
            not isinstance(target, str) or not 0 < len(target) <= 256 or not target.isprintable()
        ):
            return self._json({"ok": False, "message": "worker_id: a worker id is required"}, 400)
        assert isinstance(target, str)
        try:
            ok, message = await handler(session, target)
        except grpc.aio.AioRpcError as exc:
            if exc.code() in _SIGNED_OUT:
                self.sessions.close(sid)
                return self._json({"ok": False, "message": _SIGNED_OUT[exc.code()]}, 401)
            return self._json({"ok": False, "message": f"{exc.code().name}: {exc.details() or ''}"}, 502)
        log.info("dashboard action", extra={"action": request.path_params["action"], field_name: target, "ok": ok})
        return self._json({"ok": ok, "message": message})

    async def _replay(self, session: Session, task_id: str) -> tuple[bool, str]:
        """RequeueTasks of one id with replay_finished: REPLAYED names the new task; SKIPPED says why not."""
        request = admin_pb2.RequeueTasksRequest(
            task_ids=[task_id], replay_finished=True, reason="replayed from the dashboard"
        )
        items: list[admin_pb2.RequeueItem] = []
        async for batch in self.upstream.admin.RequeueTasks(
            request, metadata=self._metadata(session.key), timeout=self.upstream.timeout
        ):
            items.extend(batch.items)
        if not items:
            return False, f"Task {task_id} was not found."
        item = items[0]
        if item.action == "REPLAYED":
            return True, f"Task {task_id} replayed {item.detail}."
        return (
            False,
            f"Task {task_id}: {item.action.lower()}, {item.detail}."
            if item.detail
            else f"Task {task_id}: {item.action.lower()}.",
        )

    async def _redeliver(self, session: Session, task_id: str) -> tuple[bool, str]:
        answer = await self.upstream.admin.RedeliverCallback(
            admin_pb2.RedeliverCallbackRequest(task_id=task_id),
            metadata=self._metadata(session.key),
            timeout=self.upstream.timeout,
        )
        if not answer.deliveries:
            return False, f"Task {task_id} has no webhook to redeliver."
        hooks = ", ".join(f"{d.event} ({d.webhook_id})" for d in answer.deliveries)
        return True, f"Task {task_id}: redelivering {hooks}."


    async def _drain(self, session: Session, worker_id: str) -> tuple[bool, str]:
        """WorkerControl.Drain at the address the worker registered (looked up here, never taken from the page)."""
        stats = await self.upstream.admin.GetStats(
            admin_pb2.GetStatsRequest(), metadata=self._metadata(session.key), timeout=self.upstream.timeout
        )
        worker = next((w for w in stats.workers if w.worker_id == worker_id), None)
        if worker is None or not worker.alive:
            return False, f"Worker {worker_id} is not registered as alive."
        if not worker.address:
            return False, f"Worker {worker_id} has registered no control address (an older worker?)."
        async with channels.channel(self.settings, worker.address, server_name=channels.WORKER_TLS_NAME) as channel:
            control = worker_pb2_grpc.WorkerControlStub(channel)
            answer = await control.Drain(
                worker_pb2.DrainRequest(), metadata=self._metadata(session.key), timeout=self.upstream.timeout
            )
        return True, f"Worker {worker_id} is draining ({answer.running} running)."


def routes(upstream: Upstream, settings: HttpSettings) -> list[BaseRoute]:
    """The dashboard's routes over the upstream channels."""
    return Dashboard(upstream, settings).routes()
