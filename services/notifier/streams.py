"""TaskEvents: resumable server-streaming subscriptions, history from the table then live from one JetStream feed.

WatchTask with `include_output` also sends the task's partial output (services/notifier/output_feed.py), in order,
from `after_output_sequence` on, and sends its terminal event only once the output stored before it has been sent.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import random
import time
from collections import OrderedDict, defaultdict, deque
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from typing import Any, Generic, TypeVar

import asyncpg
import grpc
from google.protobuf import duration_pb2
from google.rpc import error_details_pb2
from nats.aio.msg import Msg
from nats.errors import Error as NatsError
from nats.js.api import ConsumerConfig, DeliverPolicy

from taskgate import bus as busmod
from taskgate import clienttokens, errors, eta, ids, output, results, store
from taskgate.auth import Authenticator, Caller
from taskgate.config import NotifierSettings
from taskgate.model import TaskRow
from taskgate.queueview import QueueView
from taskgate.states import Status
from taskgate.store import events as event_store
from taskgate.throttle import Throttle
from taskgate.waiting import Interrupted, unless
from taskgate.wire import events as event_wire
from taskgate_api import reasons
from taskgate_api.v1 import events_pb2, events_pb2_grpc, task_pb2

from .output_feed import OutputHub
from .progress_feed import ProgressHub

log = logging.getLogger("taskgate.notifier.streams")
K = TypeVar("K", int, str)
T = TypeVar("T")

SERVICE_NAME = "taskgate.v1.TaskEvents"
SERVICE = "events"  # the throttle's label for this service
REPLAY_PAGE = 500
MAX_CURSOR = 2**63 - 1  # cursors are event ids
TRACKED_TASKS = 100_000  # per WatchTasks stream: tasks whose last version is remembered for de-duplication
# what a quiet stream's read of the table may fail with: the keep-alive goes out, the next quiet period reads again
QUIET_READ_ERRORS = (asyncpg.PostgresError, asyncpg.InterfaceError, OSError, TimeoutError)
# what a quiet stream's read of the output stream may fail with: the keep-alive goes out, the next period reads again
OUTPUT_READ_ERRORS = (NatsError, TimeoutError)
SHUTDOWN_RETRY_MS = 200  # what a stream ended by a shutdown tells its client to wait before resuming


class Overflow(Exception):
    """The subscriber fell further behind than its buffer allows."""


class Closing(Exception):
    """This process is shutting down: its streams end, telling their clients where to resume."""


class Aged(Closing):
    """The stream reached its maximum age: it ends with a status and where to resume before the server's maximum
    connection age (plus its grace) would cut it off with none, and the client resumes over a fresh connection."""


class Subscriber:
    """One stream's bounded buffer of live events; overflowing marks it instead of dropping events silently.

    It has no timer of its own: the process's Keepalive tick wakes it when it has been quiet for a keep-alive period.
    """

    def __init__(self, key: int | str, capacity: int) -> None:
        self.key = key
        self.capacity = capacity
        self.overflowed = False
        self.closing = False
        self.quiet_since = time.monotonic()  # when the stream last got something to send (an event or a keep-alive)
        self.ends_at = math.inf  # when it ends for its age (Keepalive.add sets it)
        self._keepalive = False
        self._items: deque[task_pb2.TaskEvent | output.Live] = deque()  # events and chunks in the order they came
        self._progress: task_pb2.TaskProgress | None = None  # the newest live progress not yet taken (never buffered)
        self._ready = asyncio.Event()

    def offer(self, event: task_pb2.TaskEvent) -> bool:
        """Buffers a live event; False once the buffer has overflowed."""
        return self._offer(event)

    def offer_output(self, item: output.Live) -> bool:
        """Buffers a live output chunk (one buffer with the events, so the stream sees them in arrival order)."""
        return self._offer(item)

    def offer_progress(self, item: task_pb2.TaskProgress) -> None:
        """Keeps a live progress, replacing one not yet taken: progress never fills the buffer."""
        if not self.overflowed:
            self._progress = item
            self._ready.set()

    def _offer(self, item: task_pb2.TaskEvent | output.Live) -> bool:
        if self.overflowed:
            return False
        if len(self._items) >= self.capacity:
            self.overflowed = True
            self._items.clear()
        else:
            self._items.append(item)
        self._ready.set()
        return not self.overflowed

    async def unless_news(self, work: Awaitable[T]) -> T:
        """`work`'s result, or Interrupted (`work` cancelled) once a live event or chunk, an overflow or the end comes
        first: a quiet stream's read of the table never holds back what the feed brings meanwhile."""
        news = asyncio.ensure_future(self._news())
        try:
            return await unless(news, work)
        finally:
            news.cancel()

    async def _news(self) -> None:
        while not self._items and not self.overflowed and not self.closing:
            self._ready.clear()
            await self._ready.wait()

    def keep_alive(self) -> None:
        """The shared tick: the stream has been quiet for a period, a keep-alive is due."""
        self._keepalive = True
        self._ready.set()

    def close(self) -> None:
        """Ends the stream at its next read (Closing)."""
        self.closing = True
        self._ready.set()

    async def next(self) -> task_pb2.TaskEvent | output.Live | task_pb2.TaskProgress | None:
        """The next live event (or output chunk), else the newest live progress, or None when a keep-alive is due;
        raises Overflow or Closing. Progress does not end a quiet period: a stream that gets only progress still
        checks the table and gets its keep-alive each period."""
        while (
            not self._items and self._progress is None and not self.overflowed and not self.closing and not self._keepalive
        ):
            self._ready.clear()
            await self._ready.wait()
        now = time.monotonic()
        if self.closing:
            raise Closing
        if now >= self.ends_at:
            raise Aged
        if self.overflowed:
            raise Overflow
        if not self._items and not self._keepalive and self._progress is not None:
            progress, self._progress = self._progress, None
            return progress
        self.quiet_since = now
        self._keepalive = False
        return self._items.popleft() if self._items else None


class Keepalive:
    """One timer for every stream of the process: each tick (twice a period) wakes the streams quiet for a whole
    period, so an idle stream costs no timer, and no wake-up but its keep-alive."""

    def __init__(self, seconds: float, max_age: float = math.inf) -> None:
        self.seconds = seconds
        self.max_age = max_age
        self._subs: set[Subscriber] = set()
        self._timer: asyncio.TimerHandle | None = None

    def add(self, sub: Subscriber) -> None:
        """Starts keeping a stream alive (and the tick, with the first one), until its age ends it (90-100% of
        max_age, so the streams of one connection do not all resume at once)."""
        sub.ends_at = time.monotonic() + self.max_age * random.uniform(0.9, 1.0)
        self._subs.add(sub)
        if self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(self.seconds / 2, self._tick)

    def discard(self, sub: Subscriber) -> None:
        """Stops keeping a stream alive (and the tick, with the last one)."""
        self._subs.discard(sub)
        if not self._subs and self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _tick(self) -> None:
        now = time.monotonic()
        quiet = now - self.seconds
        for sub in self._subs:
            if sub.quiet_since <= quiet or sub.ends_at <= now:  # its next read ends a stream past its age
                sub.keep_alive()
        self._timer = asyncio.get_running_loop().call_later(self.seconds / 2, self._tick)


class Estimates:
    """The ETA that live events carry, read once per task version for every stream of this process: the versions asked
    for while a read runs go together in the next one, and each answer is kept KEEP_SECONDS for later readers. A read
    is the asked tasks' rows (one statement of primary-key reads) placed in the process's queue snapshot (`queue`),
    so it costs what was asked, never the backlog (the eta_inputs statement it replaced placed each task by counting
    its whole level: 10,000 streams' re-publish events on a 10,000-task backlog made one read of minutes)."""

    KEEP_SECONDS = 1.0
    KEPT = 10_000  # answers kept at most

    def __init__(self, pool: asyncpg.Pool, settings: NotifierSettings, queue: QueueView) -> None:
        self._pool = pool
        self._settings = settings
        self._queue = queue
        self._kept: OrderedDict[tuple[int, int], tuple[float, asyncio.Future[eta.Estimate | None]]] = OrderedDict()
        self._asked: dict[tuple[int, int], tuple[Status, asyncio.Future[eta.Estimate | None]]] = {}
        self._reader: asyncio.Task[None] | None = None

    async def estimate(self, task_id: int, version: int, status: Status) -> eta.Estimate | None:
        """eta.current of the task seen at `version` in `status`, shared by every stream that asks for that version."""
        if status not in eta.ESTIMATED:
            return None
        key = (task_id, version)
        now = time.monotonic()
        kept = self._kept.get(key)
        if kept is None or kept[0] < now:
            answer: asyncio.Future[eta.Estimate | None] = asyncio.get_running_loop().create_future()
            self._kept[key] = (now + self.KEEP_SECONDS, answer)
            self._kept.move_to_end(key)
            while len(self._kept) > self.KEPT:
                self._kept.popitem(last=False)
            self._asked[key] = (status, answer)
            if self._reader is None or self._reader.done():
                self._reader = asyncio.create_task(self._read(), name="notifier-eta")
        else:
            answer = kept[1]
        return await asyncio.shield(answer)  # a stream that ends while waiting must not cancel the others' answer

    async def stamped(self, event: task_pb2.TaskEvent) -> task_pb2.TaskEvent:
        """The event into QUEUED or PROCESSING with the task's ETA, while the task is still in that state."""
        found = await self.estimate(int(event.task_id), event.version, Status.from_proto(event.to_status))
        if found is None:
            return event
        out = task_pb2.TaskEvent()
        out.CopyFrom(event)  # a live event is shared by every stream of the task: stamp a copy
        found.stamp(out)
        return out

    async def _read(self) -> None:
        while self._asked:
            asked, self._asked = self._asked, {}
            keys = list(asked)
            found: list[eta.Estimate | None] = [None] * len(keys)
            try:
                found = await self._read_many([(t, asked[(t, v)][0]) for t, v in keys])
            except Exception:
                log.warning("ETA read failed; events go without one", exc_info=True)
                for key in keys:
                    self._kept.pop(key, None)  # not kept: the next reader asks again
            finally:  # answered even when cancelled: no stream waits on a read that will never end
                for key, estimate in zip(keys, found, strict=True):
                    answer = asked[key][1]
                    if not answer.done():
                        answer.set_result(estimate)


    async def _read_many(self, seen: list[tuple[int, Status]]) -> list[eta.Estimate | None]:
        """The estimates of the tasks seen (id, status), in order, each while the task is still in that status."""
        within = self._settings.submit_db_timeout_seconds
        rows = await store.get_tasks(self._pool, [task_id for task_id, _ in seen])
        out: list[eta.Estimate | None] = []
        for task_id, status in seen:
            row = rows.get(task_id)
            out.append(await self._queue.estimate(row, within=within) if row is not None and row.status is status else None)
        return out


class Newest(Generic[K]):
    """The newest thing each quiet stream could have missed (a task's version, a tenant's last event id), asked by
    every stream one keep-alive tick wakes and read for all of them in one statement: the asks made while a read is
    pending go together in the next. 10,000 quiet streams cost one statement per tick, not 10,000 (the streams
    benchmark, 10,000 idle WatchTask streams: with a read each, a burst's terminal events took 940 ms at p50, not 24)."""

    def __init__(self, read: Callable[[list[K]], Awaitable[dict[K, int]]]) -> None:
        self._read_many: Callable[[list[K]], Awaitable[dict[K, int]]] = read
        self._asked: dict[K, asyncio.Future[int | None]] = {}
        self._reader: asyncio.Task[None] | None = None

    async def of(self, key: K) -> int | None:
        """The newest value for `key`; None when there is none or the read failed (the next quiet period asks again)."""
        answer = self._asked.get(key)
        if answer is None:
            answer = self._asked[key] = asyncio.get_running_loop().create_future()
        if self._reader is None or self._reader.done():
            self._reader = asyncio.create_task(self._read(), name="notifier-newest")
        return await asyncio.shield(answer)  # a stream that ends while waiting must not cancel the others' answer

    async def _read(self) -> None:
        while self._asked:
            asked, self._asked = self._asked, {}
            found: dict[K, int] = {}
            try:
                found = await self._read_many(list(asked))
            except Exception:  # whatever it was, every asker gets None and the next tick asks again
                log.warning("quiet streams' check of the event table failed", exc_info=True)
            finally:  # answered even when cancelled: no stream waits on a read that will never end
                for key, answer in asked.items():
                    if not answer.done():
                        answer.set_result(found.get(key))


class EventHub:
    """Fans one ordered JetStream consumer of every task event out to the streams of this process."""

    def __init__(self, bus: busmod.Bus, heartbeat_seconds: float = 5.0) -> None:
        self._bus = bus
        self._heartbeat = heartbeat_seconds
        self._by_task: dict[int, set[Subscriber]] = defaultdict(set)
        self._by_user: dict[str, set[Subscriber]] = defaultdict(set)
        self._sub: Any = None
        self._start = 0  # the stream sequence the feed starts at: nothing before it is this process's live news
        self.closing = False

    async def start(self) -> None:
        """Subscribes from the stream's end; the ordered consumer recovers from gaps and a lost consumer by itself.

        It starts at the sequence after the stream's last rather than with DeliverPolicy.NEW: nats-py recreates a lost
        consumer (two missed heartbeats: a NATS restart, a deleted consumer) from the sequence after the last one it
        delivered, which before the first delivery is 0, i.e. the whole stream, seven days of every tenant's events,
        replayed into this process's streams (shown by test_a_lost_feed_resumes_where_it_started). So the library's
        resume point is set to the start, and anything from before it that arrives all the same is dropped.
        """
        last = (await self._bus.js.stream_info(busmod.EVENTS_STREAM)).state.last_seq
        self._start = last + 1
        self._sub = await self._bus.js.subscribe(
            busmod.EVENT_SUBJECTS,
            stream=busmod.EVENTS_STREAM,
            cb=self._on_message,
            ordered_consumer=True,
            idle_heartbeat=self._heartbeat,
            config=ConsumerConfig(deliver_policy=DeliverPolicy.BY_START_SEQUENCE, opt_start_seq=self._start),
        )
        resume = getattr(getattr(self._sub, "_sub", None), "_jsi", None)  # nats-py's ordered-consumer state
        if resume is not None and getattr(resume, "_sseq", None) == 0:
            resume._sseq = last

    async def stop(self) -> None:
        if self._sub is not None:
            with contextlib.suppress(Exception):
                await self._sub.unsubscribe()
            self._sub = None

    async def _on_message(self, msg: Msg) -> None:
        if msg.metadata.sequence.stream < self._start:
            return  # a recreated consumer replaying from before this process started (see start)
        event = event_wire.decode(msg.data)
        if event is None:
            log.error("undecodable event on the event stream", extra={"subject": msg.subject})
            return
        # routed by its subject (which only the relay may publish to), never by what the payload claims
        try:
            expected = busmod.event_subject(event.user_id, int(event.task_id))
        except ValueError:  # a user id that is no subject token
            expected = None
        if msg.subject != expected:
            log.error("event whose payload does not match its subject dropped", extra={"subject": msg.subject})
            return
        task_id = int(event.task_id)
        for sub in [*self._by_task.get(task_id, ()), *self._by_user.get(event.user_id, ())]:
            if not sub.offer(event):
                self.drop(sub)

    def watching(self, task_id: int) -> bool:
        """Whether a WatchTask stream of this process follows the task."""
        return task_id in self._by_task

    def offer_task(self, event: task_pb2.TaskEvent) -> None:
        """An event read from the table, for the task's WatchTask streams only (a WatchTasks stream's cursor follows
        the feed's order; each stream drops the feed's later copy by its version)."""
        for sub in list(self._by_task.get(int(event.task_id), ())):
            if not sub.offer(event):
                self.drop(sub)

    def watch_task(self, task_id: int, capacity: int) -> Subscriber:
        """Buffers one task's live events from now on."""
        sub = Subscriber(task_id, capacity)
        self._by_task[task_id].add(sub)
        if self.closing:
            sub.close()
        return sub

    def watch_user(self, user_id: str, capacity: int) -> Subscriber:
        """Buffers every live event of one tenant from now on."""
        sub = Subscriber(user_id, capacity)
        self._by_user[user_id].add(sub)
        if self.closing:
            sub.close()
        return sub

    def close_streams(self) -> None:
        """Shutting down: every stream (and any that opens from now on) ends with UNAVAILABLE and where to resume."""
        self.closing = True
        for subs in (*self._by_task.values(), *self._by_user.values()):
            for sub in subs:
                sub.close()

    def drop(self, sub: Subscriber) -> None:
        """Stops buffering for a subscriber."""
        table: dict[Any, set[Subscriber]] = self._by_task if isinstance(sub.key, int) else self._by_user
        subs = table.get(sub.key)
        if subs is not None:
            subs.discard(sub)
            if not subs:
                del table[sub.key]

    @property
    def subscribers(self) -> int:
        """How many streams are attached (tests and gauges)."""
        return sum(len(s) for s in self._by_task.values()) + sum(len(s) for s in self._by_user.values())


def too_slow(message: str, **metadata: str) -> errors.ApiError:
    """ABORTED with reason SUBSCRIBER_TOO_SLOW and where to resume: the client reconnects from there."""
    info = error_details_pb2.ErrorInfo(reason=reasons.SUBSCRIBER_TOO_SLOW, domain=reasons.DOMAIN, metadata=metadata)
    return errors.ApiError(grpc.StatusCode.ABORTED, message, info)


def shutting_down(message: str, **metadata: str) -> errors.ApiError:
    """UNAVAILABLE with reason NOTIFIER_SHUTTING_DOWN, where to resume and a short retry delay: another replica (or
    this one restarted) takes the stream over from there."""
    info = error_details_pb2.ErrorInfo(reason=reasons.NOTIFIER_SHUTTING_DOWN, domain=reasons.DOMAIN, metadata=metadata)
    delay = duration_pb2.Duration()
    delay.FromMilliseconds(SHUTDOWN_RETRY_MS)
    return errors.ApiError(grpc.StatusCode.UNAVAILABLE, message, info, error_details_pb2.RetryInfo(retry_delay=delay))


def aged(message: str, **metadata: str) -> errors.ApiError:
    """UNAVAILABLE with reason STREAM_MAX_AGE, where to resume and a short retry delay: the client resumes at once,
    over a new connection (the old one was told to go away at its maximum age)."""
    info = error_details_pb2.ErrorInfo(reason=reasons.STREAM_MAX_AGE, domain=reasons.DOMAIN, metadata=metadata)
    delay = duration_pb2.Duration()
    delay.FromMilliseconds(SHUTDOWN_RETRY_MS)
    return errors.ApiError(grpc.StatusCode.UNAVAILABLE, message, info, error_details_pb2.RetryInfo(retry_delay=delay))


def ended(exc: Overflow | Closing, resume: str, **metadata: str) -> errors.ApiError:
    """The status a stream ends with when the server ends it: why, and `resume` (the request field to resume with)."""
    if isinstance(exc, Overflow):
        return too_slow(f"subscriber too slow: resume with {resume}", **metadata)
    if isinstance(exc, Aged):
        return aged(f"stream reached its maximum age: resume with {resume}", **metadata)
    return shutting_down(f"notifier shutting down: resume with {resume}", **metadata)


def _statuses(values: Iterable[int]) -> set[int]:
    out = set()
    for value in values:
        if value not in task_pb2.TaskStatus.values() or value == task_pb2.TASK_STATUS_UNSPECIFIED:
            raise errors.invalid_argument([("statuses", f"unknown status {value}")])
        out.add(value)
    return out


class TaskEventsService(events_pb2_grpc.TaskEventsServicer):
    """WatchTask and WatchTasks: snapshot or history first, then live events, with keep-alives and resume points."""

    def __init__(
        self,
        settings: NotifierSettings,
        pool: asyncpg.Pool,
        hub: EventHub,
        authenticator: Authenticator,
        throttle: Throttle,
        *,
        outputs: results.ResultStore | None = None,
        output_hub: OutputHub | None = None,
        progress_hub: ProgressHub | None = None,
    ) -> None:
        self._settings = settings
        self._pool = pool
        self._hub = hub
        self._auth = authenticator
        self._throttle = throttle
        self._outputs = outputs
        self._output_hub = output_hub  # None: no output is sent (include_output ignored)
        self._progress_hub = progress_hub  # None: no live progress is sent (the events' progress only)
        self.keepalive = Keepalive(settings.stream_keepalive_seconds, settings.stream_max_age_seconds)
        self.queue = QueueView(pool, settings)  # positions and ETAs: one shared snapshot of the queue
        self.estimates = Estimates(pool, settings, self.queue)  # live events' ETAs (one read per task version)
        self.task_versions: Newest[int] = Newest(lambda ids: event_store.task_versions(pool, ids))
        self.tenant_events: Newest[str] = Newest(lambda users: event_store.last_event_ids(pool, users))

    async def _estimate(self, task: TaskRow) -> eta.Estimate | None:
        """A task's position and ETA from the process's shared queue snapshot (taskgate.queueview, as GetTask): an
        opening stream reads nothing for it (each stream's own statement grew with the backlog: 10,000 streams opening
        on 10,000 queued tasks read ~14 a second). None for a state without one, and when the snapshot cannot be read
        (the stream goes on without an ETA)."""
        try:
            return await self.queue.estimate(task, within=self._settings.submit_db_timeout_seconds)
        except QUIET_READ_ERRORS:
            log.warning("queue snapshot read failed; a snapshot goes without its ETA", exc_info=True)
            return None

    async def _stamped_latest(self, event: task_pb2.TaskEvent, task: TaskRow) -> task_pb2.TaskEvent:
        """The latest replayed event with its ETA: from the queue snapshot when it is the version the row was read at,
        else (a version committed since) from the live events' shared read."""
        if event.version != task.version:
            return await self.estimates.stamped(event)
        estimate = await self._estimate(task)
        if estimate is None:
            return event
        out = task_pb2.TaskEvent()
        out.CopyFrom(event)
        estimate.stamp(out)
        return out

    async def _quiet_check(self, read: Awaitable[list[event_store.Event]]) -> list[event_store.Event]:
        """The events a quiet stream has not had, read from the table; none when the read fails (the keep-alive goes
        out all the same, and the next quiet period asks again).

        PostgreSQL is the truth and the live feed a hint: an event the feed never brings (the relay stopped, a NATS
        node lost its unsynced writes) would otherwise be sent only when a later event of the task shows the gap, and a
        lost terminal event never, leaving the stream, and an SDK's wait(), open for ever. The cost: per keep-alive
        tick, one statement for all the quiet streams (Newest), and a read of the events for a stream that is behind.
        """
        try:
            return await read
        except QUIET_READ_ERRORS:
            log.warning("a quiet stream's check of the event table failed", exc_info=True)
            return []

    async def _tenant_events_after(self, tenant: str, after: int) -> AsyncIterator[event_store.Event]:
        """A tenant's events after an event id, in id order, a page at a time until none is left."""
        while rows := await event_store.user_events_after(self._pool, tenant, after_id=after, limit=REPLAY_PAGE):
            for row in rows:
                yield row
            after = rows[-1].id

    def _linked(self, event: task_pb2.TaskEvent) -> task_pb2.TaskEvent:
        """A terminal event with a result gets a fresh download URL (a replayed one would carry a stale URL)."""
        return results.linked_event(self._outputs, event) if self._outputs is not None else event

    async def WatchTask(
        self, request: events_pb2.WatchTaskRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[events_pb2.WatchTaskResponse]:
        # ends the stream when its key is revoked (or its client token expires)
        async with self._auth.stream_caller(context, clienttokens.WATCH) as caller:
            with self._throttle.stream(caller.principal.tenant_id, SERVICE):  # the stream's place, held until it ends
                async for response in caller.guard(self._watch_task(caller.caller, request)):
                    yield response

    async def _watch_task(
        self, who: Caller, request: events_pb2.WatchTaskRequest
    ) -> AsyncIterator[events_pb2.WatchTaskResponse]:
        task_id = ids.require(request.task_id)
        if request.after_version < 0:
            raise errors.invalid_argument([("after_version", "must not be negative")])
        if request.after_output_sequence < 0:
            raise errors.invalid_argument([("after_output_sequence", "must not be negative")])
        tenant = who.tenant_id
        outputs = self._output_hub if request.include_output else None
        progress = self._progress_hub
        # Subscribe before reading, so an event committed after the read is buffered: no gap at the seam.
        sub = self._hub.watch_task(task_id, self._settings.stream_buffer_size)
        self.keepalive.add(sub)
        sent = request.after_output_sequence  # the last output chunk sent (its stream sequence)
        try:
            if outputs is not None:  # the same for the output: followed before it is read
                await outputs.follow(tenant, task_id, sub)
            task = await store.get_task(self._pool, task_id)
            if task is None or not who.may_see(task.user_id, task.end_user, task.id):
                raise errors.not_found()
            last = request.after_version
            if last > task.version:
                raise errors.invalid_argument([("after_version", f"is ahead of the task's version {task.version}")])
            status = task.status
            attempt, shown = task.attempt, (task.progress, 0)  # the live progress sent last: (percent, step)
            following = False  # whether this stream follows the task's live progress (while it is PROCESSING)

            def moved(now: Status, at_attempt: int, percent: int) -> None:
                """The stream sent a state: its live progress is followed while that is PROCESSING."""
                nonlocal status, attempt, shown, following
                if at_attempt != attempt:
                    attempt, shown = at_attempt, (0, 0)
                status, shown = now, (max(shown[0], percent), shown[1])
                if progress is None or (now is Status.PROCESSING) == following:
                    return
                following = not following
                if following:
                    progress.follow(task.user_id, task_id, sub)
                else:
                    progress.unfollow(task_id, sub)

            async def stored(final: bool = False) -> AsyncIterator[events_pb2.WatchTaskResponse]:
                """The task's stored output after the last chunk sent (`final`: all of it, read from the leader)."""
                nonlocal sent
                if outputs is None:
                    return
                while (chunk := await outputs.read_after(tenant, task_id, sent, final=final)) is not None:
                    sent = chunk.sequence
                    yield events_pb2.WatchTaskResponse(output=chunk)

            async def before_end(event: task_pb2.TaskEvent) -> AsyncIterator[events_pb2.WatchTaskResponse]:
                """A terminal event comes after the output stored before it; any event after a chunk's catch-up."""
                if event_wire.is_terminal(event):
                    async for out in stored(final=True):
                        yield out

            if last == 0:
                estimate = await self._estimate(task)
                snapshot = task.to_proto(estimate.queue_position if estimate is not None else 0)
                if estimate is not None:
                    estimate.stamp(snapshot)
                if self._outputs is not None:
                    results.add_link(self._outputs, snapshot.result)
                yield events_pb2.WatchTaskResponse(snapshot=snapshot)
                last = task.version
            if task.status.terminal and last >= task.version:
                async for out in stored(final=True):  # a terminal snapshot: its output follows, then the end
                    yield out
                return
            # After a snapshot nothing is read: an event after the row's version committed after the row was read,
            # after this stream subscribed, so the feed brings it (and the quiet check, should the feed lose it).
            history = [] if last == task.version else await event_store.task_events(self._pool, task_id, after_version=last)
            for i, row in enumerate(history):
                event = event_wire.message(row)
                if i == len(history) - 1:  # the ETA is as of now: only the latest replayed version gets one
                    event = await self._stamped_latest(event, task)
                async for out in before_end(event):
                    yield out
                yield events_pb2.WatchTaskResponse(event=self._linked(event))
                last = event.version
                moved(Status.from_proto(event.to_status), event.attempt, event.progress)
                if event_wire.is_terminal(event):
                    return
            if task.status.terminal:
                async for out in stored(final=True):
                    yield out
                return  # its history was deleted by retention: nothing more will come
            async for out in stored():  # caught up on the output stored so far: live from here
                yield out
            moved(status, attempt, shown[0])  # live from here: its progress too, if it runs
            while True:
                try:
                    live = await sub.next()
                except (Overflow, Closing) as exc:
                    resume = f"after_version={last}" + (f" and after_output_sequence={sent}" if outputs else "")
                    meta = {"last_version": str(last)} | ({"last_output_sequence": str(sent)} if outputs else {})
                    raise ended(exc, resume, **meta) from None
                if isinstance(live, task_pb2.TaskProgress):  # newer than what was sent, of the attempt that runs
                    if status is Status.PROCESSING and live.attempt == attempt and (live.progress, live.step) > shown:
                        shown = (live.progress, live.step)
                        yield events_pb2.WatchTaskResponse(progress=live)
                    continue
                if isinstance(live, output.Live):
                    if live.chunk.sequence <= sent:
                        continue  # already read from the stream
                    if live.previous > sent:  # a chunk this stream never saw (before it followed, a lost message)
                        async for out in stored():
                            yield out
                        if live.chunk.sequence <= sent:
                            continue
                    sent = live.chunk.sequence
                    yield events_pb2.WatchTaskResponse(output=live.chunk)
                    continue
                if live is None:  # quiet for a keep-alive period: first, what the table has that the feed did not bring
                    try:  # a read that waits (a busy pool) never holds back what the feed brings meanwhile
                        newest = await sub.unless_news(self.task_versions.of(task_id))
                        missed = [] if newest is None or newest <= last else await sub.unless_news(self._quiet_check(
                            event_store.task_events(self._pool, task_id, after_version=last, up_to_version=newest)
                        ))
                    except Interrupted:
                        continue  # it goes first; the table is checked again next quiet period
                    for row in missed:
                        event = event_wire.message(row)
                        async for out in before_end(event):
                            yield out
                        yield events_pb2.WatchTaskResponse(event=self._linked(event))
                        last = event.version
                        moved(Status.from_proto(event.to_status), event.attempt, event.progress)
                        if event_wire.is_terminal(event):
                            return
                    if status is Status.PROCESSING:  # and what the stream stored that the live subject did not bring
                        try:
                            async for out in stored():
                                yield out
                        except OUTPUT_READ_ERRORS:
                            log.warning("a quiet stream's read of the output stream failed", exc_info=True)
                    yield events_pb2.WatchTaskResponse(keepalive=events_pb2.KeepAlive())
                    continue
                if live.version <= last:
                    continue  # already sent from the history (or a relay replay)
                if live.version > last + 1:  # the live feed missed some: they are in the table
                    missed = await event_store.task_events(
                        self._pool, task_id, after_version=last, up_to_version=live.version - 1
                    )
                    for row in missed:
                        event = event_wire.message(row)
                        async for out in before_end(event):
                            yield out
                        yield events_pb2.WatchTaskResponse(event=self._linked(event))
                        if event_wire.is_terminal(event):
                            return
                async for out in before_end(live):
                    yield out
                if Status.from_proto(live.to_status) in eta.ESTIMATED:
                    # its ETA is one read shared by every stream: a later event (the end) that comes while it runs is
                    # not held back behind it; this one goes without its ETA and the later one follows at once
                    with contextlib.suppress(Interrupted):
                        live = await sub.unless_news(self.estimates.stamped(live))
                yield events_pb2.WatchTaskResponse(event=self._linked(live))
                last = live.version
                moved(Status.from_proto(live.to_status), live.attempt, live.progress)
                if event_wire.is_terminal(live):
                    return
        finally:
            self.keepalive.discard(sub)
            self._hub.drop(sub)
            if outputs is not None:
                outputs.unfollow(tenant, task_id, sub)
            if progress is not None:
                progress.unfollow(task_id, sub)

    async def WatchTasks(
        self, request: events_pb2.WatchTasksRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[events_pb2.WatchTasksResponse]:
        async with self._auth.stream_caller(context, clienttokens.WATCH) as caller:
            with self._throttle.stream(caller.principal.tenant_id, SERVICE):
                async for response in caller.guard(self._watch_tasks(caller.caller, request)):
                    yield response

    async def _watch_tasks(
        self, who: Caller, request: events_pb2.WatchTasksRequest
    ) -> AsyncIterator[events_pb2.WatchTasksResponse]:
        tenant = who.tenant_id
        grant = who.grant  # a client token sees its end user's events only (and its listed tasks', if it lists)
        wanted = _statuses(request.statuses)
        cursor = 0
        if request.cursor:
            try:
                cursor = int(request.cursor)
            except ValueError:
                cursor = -1
            if not 0 <= cursor <= MAX_CURSOR:  # an event id: a PostgreSQL bigint
                raise errors.invalid_argument([("cursor", "not a cursor from this API")])
        sub = self._hub.watch_user(tenant, self._settings.stream_buffer_size)
        self.keepalive.add(sub)
        try:
            versions: OrderedDict[str, int] = OrderedDict()

            def fresh(event: task_pb2.TaskEvent) -> bool:
                """Records the event; False when this stream already sent it (history/live seam, relay replays)."""
                nonlocal cursor
                if versions.get(event.task_id, 0) >= event.version:
                    return False
                versions[event.task_id] = event.version
                versions.move_to_end(event.task_id)
                if len(versions) > TRACKED_TASKS:
                    versions.popitem(last=False)
                cursor = max(cursor, event.event_id)
                return True

            def send(event: task_pb2.TaskEvent) -> events_pb2.WatchTasksResponse | None:
                """The response for an event this stream has not sent (recorded by fresh) and whose status it wants."""
                if not fresh(event) or (wanted and event.to_status not in wanted):
                    return None
                if grant is not None and not grant.covers(event.user_id, event.end_user, int(event.task_id)):
                    return None
                return events_pb2.WatchTasksResponse(event=self._linked(event), cursor=str(cursor))

            if request.cursor:
                relayed_at = await event_store.relayed_at(self._pool, event_id=cursor, user_id=tenant)
                history = await event_store.user_events_lookback(self._pool, tenant, cursor=cursor, relayed_at=relayed_at)
                after = max(cursor, history[-1].id) if history else cursor
                for row in history:
                    if (out := send(event_wire.message(row))) is not None:
                        yield out
                async for row in self._tenant_events_after(tenant, after):
                    if (out := send(event_wire.message(row))) is not None:
                        yield out
            else:
                cursor = await event_store.last_event_id(self._pool, tenant)
            # Caught up: this keep-alive tells the client the stream is live and where it would resume.
            yield events_pb2.WatchTasksResponse(keepalive=events_pb2.KeepAlive(), cursor=str(cursor))
            # Ids commit out of order: an id below the cursor may still commit. A quiet check reads from `floor`, the
            # cursor of two checks ago (ids a whole quiet period behind the cursor), and reads again while the
            # cursor moved since: an event that commits within a quiet period of the cursor passing it is found.
            floor = checked = cursor
            while True:
                try:
                    live = await sub.next()
                except (Overflow, Closing) as exc:
                    raise ended(exc, f"cursor={cursor}", cursor=str(cursor)) from None
                if live is None:  # quiet for a keep-alive period: first, what the table has that the feed did not bring
                    try:  # a read that waits (a busy pool) never holds back what the feed brings meanwhile
                        newest = await sub.unless_news(self.tenant_events.of(tenant))
                    except Interrupted:
                        continue  # it goes first; the table is checked again next quiet period
                    if (newest is not None and newest > cursor) or floor < cursor:
                        try:
                            async for row in self._tenant_events_after(tenant, floor):
                                if (out := send(event_wire.message(row))) is not None:
                                    yield out
                            floor, checked = min(checked, cursor), cursor
                        except QUIET_READ_ERRORS:
                            log.warning("a quiet stream's check of the event table failed", exc_info=True)
                    yield events_pb2.WatchTasksResponse(keepalive=events_pb2.KeepAlive(), cursor=str(cursor))
                    continue
                if not isinstance(live, task_pb2.TaskEvent):
                    continue  # output is WatchTask's alone (a tenant's streams never follow it)
                known = versions.get(live.task_id)
                if known is not None and live.version > known + 1:  # the live feed missed some: they are in the table
                    rows = await event_store.task_events(
                        self._pool, int(live.task_id), after_version=known, up_to_version=live.version - 1
                    )
                    for row in rows:
                        if (out := send(event_wire.message(row))) is not None:
                            yield out
                if (out := send(live)) is not None:
                    yield out
        finally:
            self.keepalive.discard(sub)
            self._hub.drop(sub)


def register(service: TaskEventsService) -> Any:
    """The `register` callback of taskgate.server.start_server for this service."""

    def add(server: grpc.aio.Server) -> list[str]:
        events_pb2_grpc.add_TaskEventsServicer_to_server(service, server)
        return [SERVICE_NAME]

    return add
