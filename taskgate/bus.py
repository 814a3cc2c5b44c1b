"""NATS JetStream: the subjects, streams and durable consumers, declared here and nowhere else."""

from __future__ import annotations

import asyncio
import logging
import re
import ssl
import time
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote, urlsplit, urlunsplit

import nats
from nats.aio.client import Client as NATS
from nats.errors import Error as NatsError
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeoutError
from nats.js import JetStreamContext
from nats.js.api import (
    AckPolicy,
    ConsumerConfig,
    DeliverPolicy,
    ObjectStoreConfig,
    RePublish,
    RetentionPolicy,
    StorageType,
    StreamConfig,
)
from nats.js.errors import BadRequestError, NotFoundError, ServiceUnavailableError

from taskgate.config import CommonSettings
from taskgate.states import Priority

log = logging.getLogger("taskgate.bus")

TASKS_STREAM = "TASKS"
EVENTS_STREAM = "TASK_EVENTS"
DEAD_STREAM = "TASK_DEAD_LETTERS"
OUTPUT_STREAM = "TASK_OUTPUT"  # partial output of running tasks (taskgate/output.py), one subject per task
RESULTS_BUCKET = "taskgate-results"

TASK_SUBJECTS = "taskgate.tasks.>"
EVENT_SUBJECTS = "taskgate.events.>"
DEAD_SUBJECTS = "taskgate.dead.>"
OUTPUT_SUBJECTS = "taskgate.output.>"
# What the TASK_OUTPUT stream republishes once a chunk is stored, with its sequence (Nats-Sequence) and the previous
# one on its subject (Nats-Last-Sequence): a reader follows a task live without a consumer, and sees any gap.
OUTPUT_LIVE_SUBJECTS = "taskgate.live.output.>"
CANCEL_SUBJECT = "taskgate.control.cancel"  # core NATS: a hint to the worker running a task
PREEMPT_SUBJECT = "taskgate.control.preempt"  # core NATS: checkpoint and release a task for a higher-priority one
# core NATS: running tasks' steps, one message per tenant per tick (no row)
PROGRESS_SUBJECTS = "taskgate.live.progress.>"

_TOKEN = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


def check_token(value: str) -> str:
    """Model and tenant ids become subject tokens: no dots, wildcards or spaces."""
    if not _TOKEN.match(value):
        raise ValueError(f"{value!r} is not a valid subject token")
    return value


def task_subject(model_id: str, priority: int) -> str:
    return f"taskgate.tasks.{check_token(model_id)}.{Priority.NAMES[priority]}"


def event_subject(user_id: str, task_id: int) -> str:
    return f"taskgate.events.{check_token(user_id)}.{task_id}"


def output_subject(user_id: str, task_id: int) -> str:
    """The subject of one task's partial output (the tenant first, as events, so permissions can be per tenant)."""
    return f"taskgate.output.{check_token(user_id)}.{task_id}"


def output_live_subject(user_id: str, task_id: int) -> str:
    """Where the TASK_OUTPUT stream republishes a task's chunks once stored (core NATS: readers follow it live)."""
    return f"taskgate.live.output.{check_token(user_id)}.{task_id}"


def progress_subject(user_id: str) -> str:
    """Where workers publish the progress of a tenant's running tasks, each step (core NATS, taskgate.wire.progress)."""
    return f"taskgate.live.progress.{check_token(user_id)}"


def dead_subject(model_id: str) -> str:
    return f"taskgate.dead.{check_token(model_id)}"


def consumer_name(model_id: str, priority: int) -> str:
    """The durable consumer that every worker of a model shares for one priority level."""
    return f"tasks-{check_token(model_id)}-{Priority.NAMES[priority]}"


@dataclass(frozen=True)
class Bus:
    """A connected NATS client and its JetStream context."""

    nc: NATS
    js: JetStreamContext

    async def close(self, drain_seconds: float = 5.0, close_seconds: float = 2.0) -> None:
        """Drains (in-flight messages finish), but never for longer than `drain_seconds`; then closes.

        nats-py's drain swallows a cancellation and then flushes, so `wait_for` would not bound it: the drain runs
        as its own task, and a drain past its time is left to finish while the connection is closed under it.
        """
        if self.nc.is_closed:
            return
        drain = asyncio.create_task(self.nc.drain(), name="nats-drain")
        drain.add_done_callback(_retrieve)
        done, _ = await asyncio.wait({drain}, timeout=drain_seconds)
        if drain in done:
            failed = None if drain.cancelled() else drain.exception()
            if failed is not None:
                log.warning("NATS drain failed; closing", extra={"error": type(failed).__name__})
        else:
            log.warning("NATS drain did not finish; closing")
            drain.cancel()
        if not self.nc.is_closed:
            try:
                await asyncio.wait_for(self.nc.close(), close_seconds)
            except (TimeoutError, NatsError, OSError) as exc:
                log.warning("NATS close did not finish", extra={"error": type(exc).__name__})


def _retrieve(task: asyncio.Task[None]) -> None:
    """Marks a background task's outcome as seen (its failure is logged where it matters)."""
    if not task.cancelled():
        task.exception()


async def connect(url: str, name: str, *, tls_ca_file: Path | None = None) -> Bus:
    """Connects with endless reconnects (NATS down is a state to live through, not an exit).

    `url` may list several servers of one cluster, comma-separated; the client fails over between them. `tls://`
    servers are verified against the system CAs, or `tls_ca_file` when given (which also turns TLS on).
    """
    servers, credentials = _credentials([one.strip() for one in url.split(",") if one.strip()])
    tls: dict[str, ssl.SSLContext] = {}
    if tls_ca_file is not None:
        tls["tls"] = ssl.create_default_context(cafile=str(tls_ca_file))
    nc = await nats.connect(
        servers,
        **credentials,
        **tls,
        name=name,
        max_reconnect_attempts=1,  # the first connect fails after two tries per server: its caller retries and logs it
        reconnect_time_wait=0.5,
        connect_timeout=5,
        allow_reconnect=True,
        error_cb=_log_error,
    )
    nc.options["max_reconnect_attempts"] = -1  # once connected, reconnects never end (read at each reconnect)
    return Bus(nc=nc, js=nc.jetstream(timeout=5))


def _credentials(urls: list[str]) -> tuple[list[str], dict[str, str]]:
    """The servers without their userinfo, and that userinfo percent-decoded as nats-py's token or user and password
    (nats-py sends a URL's userinfo as written, so a token escaped to fit in the URL would not match)."""
    servers, found = [], {}
    for url in urls:
        parts = urlsplit(url if "://" in url else f"nats://{url}")
        if parts.username is not None:
            user, password = unquote(parts.username), unquote(parts.password) if parts.password is not None else None
            found = {"token": user} if password is None else {"user": user, "password": password}
            parts = parts._replace(netloc=parts.netloc.rsplit("@", 1)[1])
        servers.append(urlunsplit(parts))
    return servers, found


async def _log_error(error: Exception) -> None:
    log.warning("nats error", extra={"error": repr(error)})


STREAM_NAME_IN_USE = 10058  # JSStreamNameExistErr: declared before with another configuration, so update it
NO_PEERS_FOR_PLACEMENT = 10005  # JSClusterNoPeersErr: a cluster whose nodes have not all joined yet, so retry


async def _ensure_stream(js: JetStreamContext, config: StreamConfig) -> None:
    """Creates the stream, or updates it when it exists; any other refusal is the caller's to see."""
    try:
        await js.add_stream(config)
    except BadRequestError as exc:
        if exc.err_code != STREAM_NAME_IN_USE:
            raise
        await js.update_stream(config)


def _not_ready(exc: Exception) -> bool:
    """A JetStream that will answer soon: no answer, no leader yet, or a cluster still gathering its peers."""
    if isinstance(exc, (NatsTimeoutError, NoRespondersError, ServiceUnavailableError)):
        return True
    return isinstance(exc, BadRequestError) and exc.err_code == NO_PEERS_FOR_PLACEMENT


DECLARE_SECONDS = 60.0


async def declare(bus: Bus, settings: CommonSettings, within: float = DECLARE_SECONDS) -> None:
    """Creates (or updates) every stream, durable consumer and bucket; safe to run from every replica.

    A JetStream API that times out, has no leader yet (a cluster electing one, or busy with every replica declaring
    at once) or cannot place a stream's replicas yet (a cluster whose nodes are still joining) is retried with backoff
    for `within` seconds rather than failing the service's start.
    """
    deadline = time.monotonic() + within
    delay = 0.5
    while True:
        try:
            await _declare_once(bus, settings)
            return
        except (NatsTimeoutError, NoRespondersError, ServiceUnavailableError, BadRequestError) as exc:
            if not _not_ready(exc) or time.monotonic() + delay > deadline:
                raise
            log.warning(
                "JetStream declare did not answer; retrying", extra={"error": type(exc).__name__, "retry_in": delay}
            )
            await asyncio.sleep(delay)
            delay = min(delay * 2, 5.0)


async def _declare_once(bus: Bus, settings: CommonSettings) -> None:
    js = bus.js
    replicas = settings.stream_replicas
    await _ensure_stream(
        js,
        StreamConfig(
            name=TASKS_STREAM,
            subjects=[TASK_SUBJECTS],
            retention=RetentionPolicy.WORK_QUEUE,
            storage=StorageType.FILE,
            duplicate_window=120.0,
            num_replicas=replicas,
        ),
    )
    await _ensure_stream(
        js,
        StreamConfig(
            name=EVENTS_STREAM,
            subjects=[EVENT_SUBJECTS],
            retention=RetentionPolicy.LIMITS,
            storage=StorageType.FILE,
            max_age=7 * 24 * 3600.0,
            duplicate_window=120.0,
            num_replicas=replicas,
        ),
    )
    await _ensure_stream(
        js,
        StreamConfig(
            name=DEAD_STREAM,
            subjects=[DEAD_SUBJECTS],
            storage=StorageType.FILE,
            max_age=30 * 24 * 3600.0,
            num_replicas=replicas,
        ),
    )
    await _ensure_stream(
        js,
        StreamConfig(
            name=OUTPUT_STREAM,
            subjects=[OUTPUT_SUBJECTS],
            retention=RetentionPolicy.LIMITS,
            storage=StorageType.FILE,
            max_age=settings.output_max_age_seconds,
            duplicate_window=120.0,  # a chunk published twice (a retried publish) is stored once: Nats-Msg-Id
            num_replicas=replicas,
            allow_direct=True,  # readers get a task's chunks by sequence (direct gets), not through a consumer each
            republish=RePublish(src=OUTPUT_SUBJECTS, dest=OUTPUT_LIVE_SUBJECTS),  # stored chunks, live, sequenced
        ),
    )
    for model_id in settings.models:
        for priority in Priority.ALL:
            await ensure_task_consumer(bus, settings, model_id, priority)
    try:
        await js.object_store(RESULTS_BUCKET)
    except (NotFoundError, Exception):  # nats-py raises BucketNotFoundError (a NotFoundError subclass)
        await js.create_object_store(
            RESULTS_BUCKET, config=ObjectStoreConfig(storage=StorageType.FILE, replicas=replicas)
        )


async def ensure_task_consumer(bus: Bus, settings: CommonSettings, model_id: str, priority: int) -> str:
    name = consumer_name(model_id, priority)
    config = ConsumerConfig(
        durable_name=name,
        filter_subject=task_subject(model_id, priority),
        ack_policy=AckPolicy.EXPLICIT,
        deliver_policy=DeliverPolicy.ALL,
        ack_wait=settings.ack_wait_seconds,
        max_deliver=-1,
        max_ack_pending=10_000,
    )
    await bus.js.add_consumer(TASKS_STREAM, config)
    return name


async def level_messages(bus: Bus, model_id: str, priority: int) -> int:
    """The dispatch messages a (model, priority) level's consumer holds: waiting, or delivered and not yet acked."""
    info = await bus.js.consumer_info(TASKS_STREAM, consumer_name(model_id, priority))
    return (info.num_pending or 0) + (info.num_ack_pending or 0)
