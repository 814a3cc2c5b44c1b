"""The webhook sender: leases due outbox rows, POSTs them signed, records every attempt, and schedules retries."""

from __future__ import annotations

import asyncio
import json
import logging
import random
import time
from dataclasses import dataclass
from typing import Any

import asyncpg
import httpx

from services.notifier.outbox import iso
from taskgate import auth, eta, loops, netguard, results, telemetry, tracing
from taskgate.config import NotifierSettings
from taskgate.sealing import Sealer
from taskgate.states import CallbackStatus, Status
from taskgate.store import webhooks as webhook_store
from taskgate.waiting import cancelling
from taskgate_api import webhook_signing

log = logging.getLogger("taskgate.notifier.webhook")

USER_AGENT = "taskgate-webhooks/1"
ERROR_EXCERPT = 300


@dataclass(frozen=True, slots=True)
class Attempt:
    """What one POST came to."""

    status_code: int | None
    latency_ms: float
    error: str | None
    result: str  # bounded metric label: 2xx, 3xx, 4xx, 5xx, timeout, error, blocked, unsigned


# What the breaker counts as the destination failing: no answer, or a server error (a 4xx is the receiver's answer).
FAILING = frozenset({"timeout", "error", "5xx"})


class WebhookSender:
    """Sends due deliveries in two lanes — terminal webhooks (`webhook_concurrency` in flight) and progress webhooks
    (`webhook_progress_concurrency`), so progress never delays a result — fair across destinations (a cap in flight
    per destination over every replica, a circuit breaker per destination); several replicas share the outbox by lease.
    """

    def __init__(
        self, settings: NotifierSettings, pool: asyncpg.Pool, owner: str, *, outputs: results.ResultStore | None = None
    ) -> None:
        self._settings = settings
        self._pool = pool
        self._owner = owner
        self._outputs = outputs
        self.wake = asyncio.Event()
        self._lanes: dict[bool, set[asyncio.Task[None]]] = {False: set(), True: set()}  # progress? -> in flight
        self._sealer = Sealer.of(settings)
        self._fairness = webhook_store.Fairness(
            per_destination=settings.webhook_concurrency_per_destination,
            breaker_failures=settings.webhook_breaker_failures,
            breaker_seconds=settings.webhook_breaker_seconds,
        )
        self._client = httpx.AsyncClient(
            follow_redirects=False,
            timeout=httpx.Timeout(settings.webhook_timeout_seconds),
            limits=httpx.Limits(max_connections=settings.webhook_concurrency + settings.webhook_progress_concurrency),
            trust_env=False,  # never through an environment proxy: we pin the resolved address
            headers={"user-agent": USER_AGENT},
        )

    async def secrets(self, user_id: str) -> list[str]:
        """The tenant's webhook secrets, opened (every webhook is signed with each)."""
        return await auth.webhook_secrets(self._pool, user_id, self._sealer)

    def notify(self) -> None:
        """Wakes the sender: new deliveries were written, or a redelivery was asked for."""
        self.wake.set()

    @property
    def lease_seconds(self) -> float:
        """A lease outlives any attempt, so another replica never sends the same delivery meanwhile."""
        return max(self._settings.webhook_lease_seconds, 2 * self._settings.webhook_timeout_seconds + 5)

    async def run(self) -> None:
        """Claims and sends due deliveries on every wake-up, at retry times, and on a safety-net period."""
        await loops.repeat(
            self._pass,
            every=self._settings.webhook_scan_interval_seconds,
            wake=self.wake,
            log=log,
            failed="webhook scan failed",
            survives=(OSError, asyncpg.PostgresError, asyncpg.InterfaceError),
        )

    async def _pass(self) -> float:
        """Claims and sends what is due; the seconds until the next delivery is due (at most the scan interval)."""
        await self._claim_and_send()
        next_due = await webhook_store.seconds_to_next_due(self._pool)
        wait = self._settings.webhook_scan_interval_seconds
        return wait if next_due is None else min(wait, max(next_due, 0.005))

    @property
    def _inflight(self) -> set[asyncio.Task[None]]:
        return self._lanes[False] | self._lanes[True]

    async def _claim_and_send(self) -> None:
        sizes = {False: self._settings.webhook_concurrency, True: self._settings.webhook_progress_concurrency}
        for progress, size in sizes.items():
            lane = self._lanes[progress]
            while (free := size - len(lane)) > 0:
                rows = await webhook_store.claim_due(
                    self._pool, limit=free, owner=self._owner, lease_seconds=self.lease_seconds, progress=progress,
                    fairness=self._fairness,
                )
                for row in rows:
                    task = asyncio.create_task(self._deliver(row))
                    lane.add(task)
                    task.add_done_callback(self._finished)
                if len(rows) < free:
                    break

    def _finished(self, task: asyncio.Task[None]) -> None:
        for lane in self._lanes.values():
            lane.discard(task)
        self.wake.set()  # a slot is free again
        if not task.cancelled() and task.exception() is not None:
            log.error("webhook delivery crashed", exc_info=task.exception())

    async def _deliver(self, delivery: webhook_store.LeasedWebhook) -> None:
        attempt_no = delivery.attempts + 1
        round_no = delivery.attempts - delivery.round_start + 1
        payload = await self._with_eta(self._with_link(delivery.payload), delivery)
        body = json.dumps(payload, separators=(",", ":"), sort_keys=True).encode()
        secrets = await self.secrets(delivery.user_id)
        if secrets:
            with tracing.span(
                f"webhook {delivery.event_type}",
                parent=delivery.trace_context,
                attributes={
                    tracing.TASK_ID: str(delivery.task_id),
                    "taskgate.webhook_id": delivery.webhook_id,
                    "taskgate.attempt": attempt_no,
                },
            ):
                attempt = await self.post(delivery.url, delivery.webhook_id, body, secrets)
                tracing.annotate({"taskgate.result": attempt.result}, error=attempt.error)
        else:
            attempt = Attempt(None, 0.0, "the tenant has no webhook secret", "unsigned")
        schedule = self._settings.webhook_schedule_seconds
        if attempt.status_code is not None and 200 <= attempt.status_code < 300:
            status, delay, outcome = CallbackStatus.DELIVERED, 0.0, "delivered"
        elif attempt.status_code == 410:
            status, delay, outcome = CallbackStatus.FAILED, 0.0, "gone"
        elif delivery.event_type == webhook_store.PROGRESS_TYPE:
            # progress is not retried: a newer one follows
            status, delay, outcome = CallbackStatus.FAILED, 0.0, "dropped"
        elif round_no < len(schedule):
            jitter = self._settings.webhook_jitter
            delay = schedule[round_no] * random.uniform(1 - jitter, 1 + jitter)
            status, outcome = CallbackStatus.PENDING, "retry"
        else:
            status, delay, outcome = CallbackStatus.FAILED, 0.0, "exhausted"
        # the breaker first: a retry recorded PENDING becomes claimable after its delay (50 ms in tests), and a pass
        # that claimed it before this failure opened the breaker would send it through an open breaker
        await self._note_destination(delivery.destination, attempt)
        recorded = await webhook_store.record(
            self._pool,
            delivery,
            owner=self._owner,
            outcome=webhook_store.AttemptOutcome(
                status=status,
                delay_seconds=delay,
                status_code=attempt.status_code,
                latency_ms=attempt.latency_ms,
                error=attempt.error,
            ),
        )
        telemetry.CALLBACK_ATTEMPTS.labels(attempt.result).inc()
        log.info(
            "webhook attempt",
            extra={
                "delivery_id": delivery.id,
                "webhook_id": delivery.webhook_id,
                "event_type": delivery.event_type,
                "attempt": attempt_no,
                "status_code": attempt.status_code,
                "latency_ms": round(attempt.latency_ms, 1),
                "error": attempt.error,
                "outcome": outcome if recorded else "lease_lost",
                "next_attempt_in_s": round(delay, 3) if status is CallbackStatus.PENDING else None,
            },
        )
        if not recorded:
            return
        if status is CallbackStatus.PENDING:
            asyncio.get_running_loop().call_later(delay, self.wake.set)  # retry on time, not at the next scan
        else:
            telemetry.CALLBACK_DELIVERIES.labels(outcome).inc()
            telemetry.CALLBACK_ATTEMPTS_PER_DELIVERY.observe(round_no)
            if status is CallbackStatus.DELIVERED:
                telemetry.CALLBACK_LATENCY.observe(max(time.time() - delivery.created_at.timestamp(), 0.0))

    async def _note_destination(self, destination: str, attempt: Attempt) -> None:
        """Feeds the destination's breaker: a failure counts towards opening it, an answer closes it."""
        try:
            if attempt.result in FAILING:
                opened = await webhook_store.destination_failed(self._pool, destination, self._fairness)
                if opened is not None:
                    telemetry.CALLBACK_BREAKER_OPENED.inc()
                    log.warning("webhook destination failing: breaker open", extra={"destination": destination,
                                                                                   "open_until": iso(opened)})
            elif attempt.status_code is not None:
                await webhook_store.destination_answered(self._pool, destination)
        except (OSError, asyncpg.PostgresError, asyncpg.InterfaceError) as exc:  # advisory: the attempt is recorded
            log.warning("breaker update failed", extra={"error": f"{type(exc).__name__}: {exc}"[:ERROR_EXCERPT]})

    async def _with_eta(self, payload: dict[str, Any], delivery: webhook_store.LeasedWebhook) -> dict[str, Any]:
        """The payload with data.estimated_start and estimated_finish (null unless known): a progress webhook's ETA as
        of this attempt, while the task still runs."""
        start = finish = None
        if delivery.event_type == webhook_store.PROGRESS_TYPE:
            estimate = await eta.current(self._pool, delivery.task_id, Status.PROCESSING, self._settings)
            if estimate is not None:
                start, finish = estimate.start, estimate.finish
        data = payload.get("data") or {}
        return {**payload, "data": {**data, "estimated_start": iso(start), "estimated_finish": iso(finish)}}

    def _with_link(self, payload: dict[str, Any]) -> dict[str, Any]:
        """The payload with data.result_url: minted per attempt, so a retry an hour later still carries a live URL."""
        data = payload.get("data") or {}
        result = data.get("result") or {}
        link = self._outputs.link(result["uri"]) if self._outputs is not None and result.get("uri") else None
        if link is None:
            return payload
        return {**payload, "data": {**data, "result_url": link.url, "result_url_expires_at": iso(link.expires_at)}}

    async def post(self, url: str, webhook_id: str, body: bytes, secrets: list[str]) -> Attempt:
        """One signed POST, cut at the timeout, never following redirects, reading at most a few KiB back."""
        start = time.perf_counter()

        def elapsed() -> float:
            return (time.perf_counter() - start) * 1000

        try:
            # the one address to connect to: never the name again, which closes the DNS-rebinding gap
            pinned = await netguard.pin(
                httpx.URL(url), schemes=("http", "https"), within=self._settings.webhook_timeout_seconds,
                allow_hosts=self._settings.callback_allow_hosts,
            )
        except (netguard.Refused, httpx.InvalidURL) as exc:
            return Attempt(None, elapsed(), f"blocked: {exc}"[:ERROR_EXCERPT], "blocked")
        headers = tracing.headers(webhook_signing.headers(secrets, webhook_id, int(time.time()), body))  # + traceparent
        headers["content-type"] = "application/json"
        headers.update(pinned.headers)
        cap = self._settings.webhook_max_response_bytes
        try:
            async with asyncio.timeout(self._settings.webhook_timeout_seconds):
                async with self._client.stream(
                    "POST", pinned.url, content=body, headers=headers, extensions=pinned.extensions
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
