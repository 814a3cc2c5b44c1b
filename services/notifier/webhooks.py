"""The webhook sender: leases due outbox rows, POSTs them signed, records every attempt, and schedules retries."""

from __future__ import annotations

import asyncio
import ipaddress
import json
import logging
import random
import socket
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import asyncpg
import httpx

from taskgate import auth, sql, telemetry, webhook_signing
from taskgate.config import Settings
from taskgate.netguard import forbidden_address
from taskgate.waiting import cancelling, woken

log = logging.getLogger("taskgate.notifier.webhook")

USER_AGENT = "taskgate-webhooks/1"
ERROR_EXCERPT = 300


class Blocked(Exception):
    """The callback URL is not one we may call (scheme, or an address that is not public and not allow-listed)."""


@dataclass(frozen=True, slots=True)
class Attempt:
    """What one POST came to."""

    status_code: int | None
    latency_ms: float
    error: str | None
    result: str  # bounded metric label: 2xx, 3xx, 4xx, 5xx, timeout, error, blocked, unsigned


def _public(ip: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    return not forbidden_address(ip)


async def resolve(url: httpx.URL, allow_hosts: list[str]) -> str:
    """The address to connect to: the first resolved one that is public or allow-listed; else Blocked.

    Resolving here and connecting to that very address (not the name) closes the DNS-rebinding gap.
    """
    if url.scheme not in ("http", "https") or not url.host:
        raise Blocked(f"scheme {url.scheme!r} is not allowed")
    host = url.host
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError as exc:
        raise Blocked(f"cannot resolve {host}: {exc}") from None
    for info in infos:
        address = str(info[4][0])
        ip = ipaddress.ip_address(address.split("%", 1)[0])
        if host in allow_hosts or address in allow_hosts or _public(ip):
            return address
    raise Blocked(f"{host} resolves only to non-public addresses")


class WebhookSender:
    """Sends due deliveries with at most `webhook_concurrency` in flight; several replicas share the outbox by lease."""

    def __init__(self, settings: Settings, pool: asyncpg.Pool, owner: str) -> None:
        self._settings = settings
        self._pool = pool
        self._owner = owner
        self.wake = asyncio.Event()
        self._inflight: set[asyncio.Task[None]] = set()
        self._client = httpx.AsyncClient(
            follow_redirects=False,
            timeout=httpx.Timeout(settings.webhook_timeout_seconds),
            limits=httpx.Limits(max_connections=settings.webhook_concurrency),
            trust_env=False,  # never through an environment proxy: we pin the resolved address
            headers={"user-agent": USER_AGENT},
        )

    def notify(self) -> None:
        """Wakes the sender: new deliveries were written, or a redelivery was asked for."""
        self.wake.set()

    @property
    def lease_seconds(self) -> float:
        """A lease outlives any attempt, so another replica never sends the same delivery meanwhile."""
        return max(self._settings.webhook_lease_seconds, 2 * self._settings.webhook_timeout_seconds + 5)

    async def run(self) -> None:
        """Claims and sends due deliveries on every wake-up, at retry times, and on a safety-net period."""
        while True:
            self.wake.clear()
            try:
                await self._claim_and_send()
                next_due = await self._pool.fetchval(sql.query("webhook_next_due"))
            except (OSError, asyncpg.PostgresError, asyncpg.InterfaceError) as exc:
                if cancelling():
                    raise asyncio.CancelledError from exc
                log.warning("webhook scan failed", extra={"error": f"{type(exc).__name__}: {exc}"[:ERROR_EXCERPT]})
                next_due = None
            wait = self._settings.webhook_scan_interval_seconds
            if next_due is not None:
                wait = min(wait, max(float(next_due), 0.005))
            await woken(self.wake, wait)

    async def _claim_and_send(self) -> None:
        while True:
            free = self._settings.webhook_concurrency - len(self._inflight)
            if free <= 0:
                return
            rows = await self._pool.fetch(sql.query("webhook_claim"), free, self._owner, self.lease_seconds)
            for row in rows:
                task = asyncio.create_task(self._deliver(row))
                self._inflight.add(task)
                task.add_done_callback(self._finished)
            if len(rows) < free:
                return

    def _finished(self, task: asyncio.Task[None]) -> None:
        self._inflight.discard(task)
        self.wake.set()  # a slot is free again
        if not task.cancelled() and task.exception() is not None:
            log.error("webhook delivery crashed", exc_info=task.exception())

    async def _deliver(self, row: Mapping[str, Any]) -> None:
        attempt_no = row["attempts"] + 1
        round_no = row["attempts"] - row["round_start"] + 1
        body = json.dumps(row["payload"], separators=(",", ":"), sort_keys=True).encode()
        secrets = await auth.webhook_secrets(self._pool, row["user_id"])
        if secrets:
            attempt = await self.post(row["url"], row["webhook_id"], body, secrets)
        else:
            attempt = Attempt(None, 0.0, "the tenant has no webhook secret", "unsigned")
        schedule = self._settings.webhook_schedule_seconds
        if attempt.status_code is not None and 200 <= attempt.status_code < 300:
            status, delay, outcome = "DELIVERED", 0.0, "delivered"
        elif attempt.status_code == 410:
            status, delay, outcome = "FAILED", 0.0, "gone"
        elif round_no < len(schedule):
            jitter = self._settings.webhook_jitter
            status, delay, outcome = "PENDING", schedule[round_no] * random.uniform(1 - jitter, 1 + jitter), "retry"
        else:
            status, delay, outcome = "FAILED", 0.0, "exhausted"
        recorded = await self._record(row, attempt_no, status, delay, attempt)
        telemetry.CALLBACK_ATTEMPTS.labels(attempt.result).inc()
        log.info(
            "webhook attempt",
            extra={
                "delivery_id": row["id"],
                "webhook_id": row["webhook_id"],
                "event_type": row["event_type"],
                "attempt": attempt_no,
                "status_code": attempt.status_code,
                "latency_ms": round(attempt.latency_ms, 1),
                "error": attempt.error,
                "outcome": outcome if recorded else "lease_lost",
                "next_attempt_in_s": round(delay, 3) if status == "PENDING" else None,
            },
        )
        if not recorded:
            return
        if status == "PENDING":
            asyncio.get_running_loop().call_later(delay, self.wake.set)  # retry on time, not at the next scan
        else:
            telemetry.CALLBACK_DELIVERIES.labels(outcome).inc()
            telemetry.CALLBACK_ATTEMPTS_PER_DELIVERY.observe(round_no)
            if status == "DELIVERED":
                telemetry.CALLBACK_LATENCY.observe(max(time.time() - row["created_at"].timestamp(), 0.0))

    async def _record(self, row: Mapping[str, Any], attempt_no: int, status: str, delay: float, attempt: Attempt) -> bool:
        """Writes the outcome under the lease, the attempt log row, and the task's callback status, together."""
        async with self._pool.acquire() as conn, conn.transaction():
            done = await conn.fetchrow(
                sql.query("webhook_record"), row["id"], self._owner, status, delay, attempt.status_code, attempt.error
            )
            if done is None:
                return False  # the lease was lost (expired, or the row was redelivered and taken by another replica)
            await conn.execute(
                sql.query("webhook_insert_attempt"),
                row["id"],
                attempt_no,
                row["webhook_id"],
                attempt.status_code,
                attempt.latency_ms,
                attempt.error,
            )
            if row["event_type"] != "task.progress":
                retries = done["attempts"] - done["round_start"] - 1
                task_status = "PENDING" if status == "PENDING" else status
                await conn.execute(sql.query("webhook_task_status"), row["task_id"], task_status, retries)
        return True

    async def post(self, url: str, webhook_id: str, body: bytes, secrets: list[str]) -> Attempt:
        """One signed POST, cut at the timeout, never following redirects, reading at most a few KiB back."""
        start = time.perf_counter()

        def elapsed() -> float:
            return (time.perf_counter() - start) * 1000

        try:
            target = httpx.URL(url)
            address = await resolve(target, self._settings.callback_allow_hosts)
        except (Blocked, httpx.InvalidURL) as exc:
            return Attempt(None, elapsed(), f"blocked: {exc}"[:ERROR_EXCERPT], "blocked")
        headers = webhook_signing.headers(secrets, webhook_id, int(time.time()), body)
        headers["content-type"] = "application/json"
        headers["host"] = target.netloc.decode("ascii")
        extensions = {"sni_hostname": target.host} if target.scheme == "https" else {}
        cap = self._settings.webhook_max_response_bytes
        try:
            async with asyncio.timeout(self._settings.webhook_timeout_seconds):
                async with self._client.stream(
                    "POST", target.copy_with(host=address), content=body, headers=headers, extensions=extensions
                ) as response:
                    received = bytearray()
                    async for chunk in response.aiter_raw():
                        received += chunk
                        if len(received) >= cap:
                            break
                    code = response.status_code
        except TimeoutError:
            return Attempt(None, elapsed(), f"timeout after {self._settings.webhook_timeout_seconds}s", "timeout")
        except httpx.TimeoutException as exc:
            return Attempt(None, elapsed(), f"timeout: {type(exc).__name__}", "timeout")
        except (httpx.HTTPError, OSError) as exc:
            if cancelling():
                raise asyncio.CancelledError from exc
            return Attempt(None, elapsed(), f"{type(exc).__name__}: {exc}"[:ERROR_EXCERPT], "error")
        error = None
        if not 200 <= code < 300:
            excerpt = bytes(received[:cap]).decode("utf-8", "replace")
            location = response.headers.get("location")
            error = (f"HTTP {code}" + (f" to {location}" if location else "") + (f": {excerpt}" if excerpt else ""))[
                :ERROR_EXCERPT
            ]
        return Attempt(code, elapsed(), error, f"{code // 100}xx")

    async def stop(self) -> None:
        """Waits for attempts in flight (each is bounded by the timeout), then closes the HTTP client."""
        if self._inflight:
            await asyncio.wait(self._inflight, timeout=self._settings.webhook_timeout_seconds + 1)
        await self.kill()

    async def kill(self) -> None:
        """Abandons attempts in flight (their leases expire and another replica retries)."""
        for task in list(self._inflight):
            task.cancel()
        await self._client.aclose()
