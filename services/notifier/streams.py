"""TaskEvents: resumable server-streaming subscriptions, history from the table then live from one JetStream feed.

The servicer (TaskEventsService: WatchTask, WatchTasks) and its stream handlers; what they are made of lives beside it:
each stream's live buffer and keep-alive (subscriber.py), the event feed (event_feed.py), the reads the streams share
(shared_reads.py). WatchTask with `include_output` also sends the task's partial output (output_feed.py), in order,
from `after_output_sequence` on, and sends its terminal event only once the output stored before it has been sent.
"""

from __future__ import annotations

import contextlib
import logging
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from typing import Any, TypeVar, cast

import asyncpg
import grpc
from nats.errors import Error as NatsError

from taskgate import clienttokens, errors, eta, ids, output, results, store
from taskgate.auth import Authenticator, Caller
from taskgate.config import NotifierSettings
from taskgate.model import TaskRow
from taskgate.queueview import QueueView
from taskgate.states import Status
from taskgate.store import events as event_store
from taskgate.throttle import Throttle
from taskgate.waiting import Interrupted
from taskgate.wire import events as event_wire
from taskgate_api.v1 import events_pb2, events_pb2_grpc, task_pb2

from .event_feed import EventHub
from .output_feed import OutputHub
from .progress_feed import ProgressHub
from .shared_reads import Estimates
from .subscriber import Closing, Keepalive, Overflow, Subscriber, ended
from .taskwatch import KEEPALIVE, TaskWatch

log = logging.getLogger("taskgate.notifier.streams")
R = TypeVar("R")
Q = TypeVar("Q")
Live = task_pb2.TaskEvent | output.Live | task_pb2.TaskProgress | None  # what a stream's subscriber brings

SERVICE_NAME = "taskgate.v1.TaskEvents"
SERVICE = "events"  # the throttle's label for this service
REPLAY_PAGE = 500
MAX_CURSOR = 2**63 - 1  # cursors are event ids
TRACKED_TASKS = 100_000  # per WatchTasks stream: tasks whose last version is remembered for de-duplication
# what a quiet stream's read of the table may fail with: the keep-alive goes out, the next quiet period reads again
QUIET_READ_ERRORS = (asyncpg.PostgresError, asyncpg.InterfaceError, OSError, TimeoutError)
# what a quiet stream's read of the output stream may fail with: the keep-alive goes out, the next period reads again
OUTPUT_READ_ERRORS = (NatsError, TimeoutError)



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
        # the quiet streams' keep-alives, and the newest version of each one's task (or tenant's event id), read for
        # all of them in one statement per tick
        self.keepalive = Keepalive(settings.stream_keepalive_seconds, settings.stream_max_age_seconds, self._newest)
        self.queue = QueueView(pool, settings)  # positions and ETAs: one shared snapshot of the queue
        self.estimates = Estimates(pool, settings, self.queue)  # live events' ETAs (one read per task version)

    async def _newest(self, keys: list[int | str]) -> dict[int | str, int]:
        """What the table has for quiet streams' keys: a WatchTask's task's newest version, a WatchTasks' tenant's last
        event id."""
        tasks = [key for key in keys if isinstance(key, int)]
        users = [key for key in keys if isinstance(key, str)]
        found: dict[int | str, int] = {}
        if tasks:
            found.update((await event_store.task_versions(self._pool, tasks)).items())
        if users:
            found.update(await event_store.last_event_ids(self._pool, users))
        return found

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

    async def _snapshot(self, task: TaskRow) -> events_pb2.WatchTaskResponse:
        """A WatchTask stream's first item: the task as it is, with its queue position and ETA."""
        estimate = await self._estimate(task)
        snapshot = task.to_proto(estimate.queue_position if estimate is not None else 0)
        if estimate is not None:
            estimate.stamp(snapshot)
        if self._outputs is not None:
            results.add_link(self._outputs, snapshot.result)
        return events_pb2.WatchTaskResponse(snapshot=snapshot)

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
        tick, one statement for all the quiet streams (Keepalive), and a read of the events for a stream that is behind.
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

    async def _serve(
        self, context: grpc.aio.ServicerContext, handle: Callable[[Caller, Q], AsyncIterator[R]], request: Q
    ) -> AsyncIterator[R]:
        """What WatchTask and WatchTasks do around their stream: the caller authenticated (the stream ends when its key
        is revoked or its client token expires) and the stream's place in its tenant's throttle held until it ends.
        No context manager, and nothing it sent kept: held by 10,000s."""
        caller = await self._auth.open_stream(context, clienttokens.WATCH)
        try:
            tenant = caller.principal.tenant_id
            self._throttle.open_stream(tenant, SERVICE)  # the stream's place, held until it ends
            try:
                stream = caller.guard(handle(caller.caller, request))
                while True:
                    try:
                        response = await anext(stream)
                    except StopAsyncIteration:
                        return
                    yield response
                    del response
            finally:
                self._throttle.close_stream(tenant)
        finally:
            self._auth.close_stream(caller)

    def _dropped(self, sub: Subscriber) -> None:
        """A stream's subscriber ended: out of the keep-alive tick and the feed."""
        self.keepalive.discard(sub)
        self._hub.drop(sub)

    async def _missed(self, task_id: int, after: int, live: task_pb2.TaskEvent) -> list[event_store.Event]:
        """The task's events after version `after` and before the live event that showed the feed missed them."""
        return await event_store.task_events(self._pool, task_id, after_version=after, up_to_version=live.version - 1)

    def WatchTask(
        self, request: events_pb2.WatchTaskRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[events_pb2.WatchTaskResponse]:
        # the stream itself: no generator around it; its keep-alives are bytes (KEEPALIVE), which the server sends
        return cast(AsyncIterator[events_pb2.WatchTaskResponse], self._serve(context, self._watch_task, request))

    async def _replay(
        self, w: TaskWatch, task: TaskRow, history: list[event_store.Event]
    ) -> AsyncIterator[events_pb2.WatchTaskResponse]:
        """A resumed stream's history after its version, the latest with its ETA; ends the stream at a terminal event
        (w.last is then that event's version, w.status terminal)."""
        for i, row in enumerate(history):
            event = event_wire.message(row)
            if i == len(history) - 1:  # the ETA is as of now: only the latest replayed version gets one
                event = await self._stamped_latest(event, task)
            async for out in w.before_end(event):
                yield out
            yield events_pb2.WatchTaskResponse(event=self._linked(event))
            w.last = event.version
            w.moved(Status.from_proto(event.to_status), event.attempt, event.progress)
            if event_wire.is_terminal(event):
                return

    async def _watch_task(
        self, who: Caller, request: events_pb2.WatchTaskRequest
    ) -> AsyncIterator[events_pb2.WatchTaskResponse | bytes]:
        task_id = ids.require(request.task_id)
        if request.after_version < 0:
            raise errors.invalid_argument([("after_version", "must not be negative")])
        if request.after_output_sequence < 0:
            raise errors.invalid_argument([("after_output_sequence", "must not be negative")])
        outputs = self._output_hub if request.include_output else None
        # Subscribe before reading, so an event committed after the read is buffered: no gap at the seam.
        sub = self._hub.watch_task(task_id, self._settings.stream_buffer_size)
        self.keepalive.add(sub)  # kept alive (and ended at its age) while the stream lasts
        w = TaskWatch(sub, task_id, who.tenant_id, outputs, self._progress_hub, request.after_output_sequence)
        try:
            if outputs is not None:  # the same for the output: followed before it is read
                await outputs.follow(w.tenant, task_id, sub)
            task = await store.get_task(self._pool, task_id)
            if task is None or not who.may_see(task.user_id, task.end_user, task.id):
                raise errors.not_found()
            w.last = request.after_version
            if w.last > task.version:
                raise errors.invalid_argument([("after_version", f"is ahead of the task's version {task.version}")])
            w.status, w.owner, w.attempt, w.shown = task.status, task.user_id, task.attempt, (task.progress, 0)
            if w.last == 0:
                yield await self._snapshot(task)
                w.last = task.version
            if task.status.terminal and w.last >= task.version:
                async for out in w.stored(final=True):  # a terminal snapshot: its output follows, then the end
                    yield out
                return
            # After a snapshot nothing is read: an event after the row's version committed after the row was read,
            # after this stream subscribed, so the feed brings it (and the quiet check, should the feed lose it).
            if w.last != task.version:
                history = await event_store.task_events(self._pool, task_id, after_version=w.last)
                async for out in self._replay(w, task, history):
                    yield out
                if history and w.status.terminal:  # it ended at its terminal event (always a task's last version)
                    return
            if task.status.terminal:
                async for out in w.stored(final=True):
                    yield out
                return  # its history was deleted by retention: nothing more will come
            if outputs is not None:  # (an ended generator's StopAsyncIteration would give this frame a frame object)
                async for out in w.stored():  # caught up on the output stored so far: live from here
                    yield out
            w.moved(w.status, w.attempt, w.shown[0])  # live from here: its progress too, if it runs
            del task  # not held for the stream's life (the row, its request's payload: ~2 KiB a stream)
            while True:
                try:
                    live = await sub.next()
                except (Overflow, Closing) as exc:
                    raise w.ended(exc) from None
                if isinstance(live, task_pb2.TaskProgress):
                    if w.newer_progress(live):
                        yield events_pb2.WatchTaskResponse(progress=live)
                    continue
                if isinstance(live, output.Live):
                    if live.chunk.sequence <= w.sent:
                        continue  # already read from the stream
                    if live.previous > w.sent:  # a chunk this stream never saw (before it followed, a lost message)
                        async for out in w.stored():
                            yield out
                        if live.chunk.sequence <= w.sent:
                            continue
                    w.sent = live.chunk.sequence
                    yield events_pb2.WatchTaskResponse(output=live.chunk)
                    continue
                # quiet for a keep-alive period: first, what the table has that the feed did not bring
                if live is None:
                    if sub.newest is not None and sub.newest > w.last:  # the tick's read: the table has more
                        behind = event_store.task_events(
                            self._pool, task_id, after_version=w.last, up_to_version=sub.newest
                        )
                        try:  # a read that waits (a busy pool) never holds back what the feed brings meanwhile
                            missed = await sub.unless_news(self._quiet_check(behind))
                        except Interrupted:
                            continue  # it goes first; the table is checked again next quiet period
                        for row in missed:
                            event = event_wire.message(row)
                            async for out in w.before_end(event):
                                yield out
                            yield events_pb2.WatchTaskResponse(event=self._linked(event))
                            w.last = event.version
                            w.moved(Status.from_proto(event.to_status), event.attempt, event.progress)
                            if event_wire.is_terminal(event):
                                return
                    # and what the output stream stored that the live subject did not bring
                    if w.status is Status.PROCESSING:
                        try:
                            async for out in w.stored():
                                yield out
                        except OUTPUT_READ_ERRORS:
                            log.warning("a quiet stream's read of the output stream failed", exc_info=True)
                    yield KEEPALIVE
                    continue
                if live.version <= w.last:
                    continue  # already sent from the history (or a relay replay)
                if live.version > w.last + 1:  # the live feed missed some: they are in the table
                    for row in await self._missed(task_id, w.last, live):
                        event = event_wire.message(row)
                        async for out in w.before_end(event):
                            yield out
                        yield events_pb2.WatchTaskResponse(event=self._linked(event))
                        if event_wire.is_terminal(event):
                            return
                async for out in w.before_end(live):
                    yield out
                if Status.from_proto(live.to_status) in eta.ESTIMATED:
                    # its ETA is one read shared by every stream: a later event (the end) that comes while it runs
                    # is not held back behind it; this one goes without its ETA and the later one follows at once
                    with contextlib.suppress(Interrupted):
                        live = await sub.unless_news(self.estimates.stamped(live))
                yield events_pb2.WatchTaskResponse(event=self._linked(live))
                w.last = live.version
                w.moved(Status.from_proto(live.to_status), live.attempt, live.progress)
                if event_wire.is_terminal(live):
                    return
        finally:
            w.unfollow()
            self._dropped(sub)

    def WatchTasks(
        self, request: events_pb2.WatchTasksRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[events_pb2.WatchTasksResponse]:
        return self._serve(context, self._watch_tasks, request)

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
        self.keepalive.add(sub)  # kept alive (and ended at its age) while the stream lasts
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
                history = await event_store.user_events_lookback(
                    self._pool, tenant, cursor=cursor, relayed_at=relayed_at
                )
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
                    if (sub.newest is not None and sub.newest > cursor) or floor < cursor:  # the tick's read
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
                    for row in await self._missed(int(live.task_id), known, live):
                        if (out := send(event_wire.message(row))) is not None:
                            yield out
                if (out := send(live)) is not None:
                    yield out
        finally:
            self._dropped(sub)


def register(service: TaskEventsService) -> Any:
    """The `register` callback of taskgate.server.start_server for this service."""

    def add(server: grpc.aio.Server) -> list[str]:
        events_pb2_grpc.add_TaskEventsServicer_to_server(service, server)
        return [SERVICE_NAME]

    return add
