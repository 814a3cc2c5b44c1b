"""Output webhooks, opt-in: a running task's partial output posted to its callback URL, coalesced and best-effort.

A task opts in with the callback event "OUTPUT" (never by default). When this process's relay publishes its move into
PROCESSING, this process follows the task's output (OutputHub: the core subscription WatchTask streams use, gaps read
back by sequence) and, every `webhook_output_window_seconds`, posts ONE `task.output` webhook carrying every chunk
stored since the last delivered one (up to `webhook_output_max_bytes`; the rest go straight after) and their sequence
range, signed like every webhook. A failed post is not retried as such: its chunks stay and the next post covers them
too (a wider range, a new webhook-id); once the task has ended, what is left is tried for FINAL_TRIES more windows,
then dropped. Nothing is written to PostgreSQL and nothing outlives this process: the terminal webhook (sent by the
outbox, never behind these) and GetTaskResult are the truth, and a task.output webhook may arrive after it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

from services.notifier import outbox
from services.notifier.event_feed import EventHub
from services.notifier.output_feed import OutputHub
from services.notifier.subscriber import Closing, Overflow, Subscriber
from services.notifier.webhooks import WebhookSender
from taskgate import output
from taskgate.config import NotifierSettings
from taskgate.states import Status
from taskgate.store.events import RelayEvent
from taskgate_api.v1 import task_pb2

log = logging.getLogger("taskgate.notifier.output_hooks")

OUTPUT_TYPE = "task.output"
FINAL_TRIES = 3  # windows in which an ended task's undelivered output is tried again before it is dropped
EVENT_CAPACITY = 64  # a followed task's live events buffered between reads (a few per window at most)
_TERMINAL = frozenset(s.to_proto() for s in Status if s.terminal)


def chunk_json(chunk: task_pb2.OutputChunk) -> dict[str, Any]:
    """One chunk as a task.output webhook writes it (a text chunk's `offset` is where it starts in its attempt's
    text)."""
    return {
        "sequence": chunk.sequence,
        "attempt": chunk.attempt,
        "kind": output.kind_name(chunk.kind),
        "text": chunk.text,
        "offset": chunk.offset,
        "uri": chunk.uri,
        "content_type": chunk.content_type,
        "step": chunk.step,
        "at": outbox.iso(chunk.at.ToDatetime()) if chunk.HasField("at") else None,
    }


def _size(chunk: task_pb2.OutputChunk) -> int:
    return len(chunk.text.encode()) + len(chunk.uri) + 200  # the JSON around it, roughly


class OutputHooks:
    """The opted-in running tasks whose relay events this process published, each followed until it ends."""

    def __init__(self, settings: NotifierSettings, sender: WebhookSender, hub: EventHub, outputs: OutputHub) -> None:
        self._settings = settings
        self._sender = sender
        self._hub = hub
        self._outputs = outputs
        # POSTs in flight: the progress lane's size
        self._slots = asyncio.Semaphore(settings.webhook_progress_concurrency)
        self._followers: dict[int, _Follower] = {}
        self._running: set[asyncio.Task[None]] = set()

    def relayed(self, rows: Sequence[RelayEvent]) -> None:
        """A relay pass of this process committed `rows`: follows the opted-in tasks that started running."""
        ended = {r.event.task_id for r in rows if r.event.to_status.terminal}
        for row in rows:
            event = row.event
            follower = self._followers.get(event.task_id)
            if follower is not None:
                follower.ended |= event.task_id in ended
                continue
            if (
                event.to_status is not Status.PROCESSING
                or not row.callback_url
                or not outbox.wants_output(row.callback_events)
            ):
                continue
            follower = _Follower(
                self,
                event.task_id,
                event.user_id,
                row.callback_url,
                self._hub.watch_task(event.task_id, EVENT_CAPACITY),
            )
            follower.ended = event.task_id in ended  # ended in this very pass: flush what it wrote, then stop
            self._followers[event.task_id] = follower
            task = asyncio.create_task(follower.run(), name="notifier-output-hooks")
            self._running.add(task)
            task.add_done_callback(self._running.discard)

    @property
    def followed(self) -> int:
        """How many tasks this process posts output webhooks for (tests and gauges)."""
        return len(self._followers)

    async def stop(self) -> None:
        """Stops following (what is not delivered yet is dropped: best-effort by design)."""
        for task in list(self._running):
            task.cancel()
        await asyncio.gather(*self._running, return_exceptions=True)


class _Follower:
    """One task: its chunks not yet delivered (in sequence order), the last sequence it has, its live events."""

    def __init__(self, hooks: OutputHooks, task_id: int, user_id: str, url: str, events: Subscriber) -> None:
        self.hooks = hooks
        self.task_id = task_id
        self.user_id = user_id
        self.url = url
        self.events = events
        self.ended = False
        self.pending: list[task_pb2.OutputChunk] = []
        self.last = 0  # the newest sequence in `pending` or delivered
        self.gap = True  # what was stored before the subscription is read back first

    def offer_output(self, item: output.Live) -> bool:
        """A live chunk: kept when it follows the last one, else the gap is read back by sequence before the next
        post."""
        if item.chunk.sequence > self.last:
            if item.previous == self.last:
                self.pending.append(item.chunk)
                self.last = item.chunk.sequence
            else:
                self.gap = True
        return True

    async def run(self) -> None:
        hooks = self.hooks
        window = hooks._settings.webhook_output_window_seconds
        tries = FINAL_TRIES
        try:
            await hooks._outputs.follow(self.user_id, self.task_id, self)
            while True:
                await self._wait(window)
                await self._read_missed()
                if await self._post_all() and self.ended:
                    return
                if self.ended:
                    tries -= 1
                    if tries <= 0:
                        log.info(
                            "output webhooks dropped", extra={"task_id": str(self.task_id), "chunks": len(self.pending)}
                        )
                        return
                    await asyncio.sleep(window)  # an ended task's wait is not cut short: the next try one window on
        except Closing:
            return
        except Exception as exc:  # best-effort: a failure ends this task's output webhooks, never the process
            log.warning("output webhooks stopped", extra={"task_id": str(self.task_id), "error": repr(exc)[:300]})
        finally:
            hooks._hub.drop(self.events)
            hooks._outputs.unfollow(self.user_id, self.task_id, self)
            if hooks._followers.get(self.task_id) is self:
                del hooks._followers[self.task_id]

    async def _wait(self, window: float) -> None:
        """A window, cut short by the task's end (its last output goes at once)."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(window):
                while not self.ended:
                    try:
                        event = await self.events.next()
                    except Overflow:  # cannot happen at a few events a window; end as if it ended
                        self.ended = True
                        return
                    if isinstance(event, task_pb2.TaskEvent) and event.to_status in _TERMINAL:
                        self.ended = True

    async def _read_missed(self) -> None:
        """Reads back by sequence what the subscription missed; everything stored once the task ended (the leader's)."""
        if not (self.gap or self.ended):
            return
        self.gap = False
        while (
            chunk := await self.hooks._outputs.read_after(self.user_id, self.task_id, self.last, final=self.ended)
        ) is not None:
            if chunk.sequence > self.last:
                self.pending.append(chunk)
                self.last = chunk.sequence

    async def _post_all(self) -> bool:
        """Posts the pending chunks (several webhooks when over the size cap); whether all went."""
        cap = self.hooks._settings.webhook_output_max_bytes
        while self.pending:
            batch: list[task_pb2.OutputChunk] = []
            size = 0
            for chunk in self.pending:
                if batch and size + _size(chunk) > cap:
                    break
                batch.append(chunk)
                size += _size(chunk)
            if not await self._post(batch):
                return False
            del self.pending[: len(batch)]
        return True

    async def _post(self, batch: list[task_pb2.OutputChunk]) -> bool:
        first, last = batch[0].sequence, batch[-1].sequence
        payload = {
            "type": OUTPUT_TYPE,
            "timestamp": outbox.iso(datetime.now(UTC)),
            "data": {
                "task_id": str(self.task_id),
                "first_sequence": first,
                "last_sequence": last,
                "chunks": [chunk_json(c) for c in batch],
            },
        }
        body = json.dumps(payload, separators=(",", ":"), sort_keys=True).encode()
        webhook_id = f"msg_{self.task_id}_out_{first}_{last}"
        secrets = await self.hooks._sender.secrets(self.user_id)
        if not secrets:
            return False
        async with self.hooks._slots:
            attempt = await self.hooks._sender.post(self.url, webhook_id, body, secrets)
        delivered = attempt.status_code is not None and 200 <= attempt.status_code < 300
        log.info(
            "output webhook attempt",
            extra={
                "task_id": str(self.task_id),
                "webhook_id": webhook_id,
                "status_code": attempt.status_code,
                "latency_ms": round(attempt.latency_ms, 1),
                "error": attempt.error,
            },
        )
        if attempt.status_code == 410:  # the receiver wants no more of this task
            self.pending.clear()
            self.ended = True
            return True
        return delivered
