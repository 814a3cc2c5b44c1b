"""One stream's live side: Subscriber (its bounded buffer of live events, output chunks and progress), Keepalive (the
process's one timer that wakes the streams quiet for a keep-alive period and ends those past their age), what a
stream's read ends with (Overflow, Closing, Aged) and the status each ends the stream with (`ended`: why, and where
to resume)."""

from __future__ import annotations

import asyncio
import math
import random
import time
from collections import deque
from collections.abc import Awaitable
from typing import TypeVar

import grpc
from google.protobuf import duration_pb2
from google.rpc import error_details_pb2

from taskgate import errors, output
from taskgate.waiting import unless
from taskgate_api import reasons
from taskgate_api.v1 import task_pb2

T = TypeVar("T")

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
            not self._items
            and self._progress is None
            and not self.overflowed
            and not self.closing
            and not self._keepalive
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
