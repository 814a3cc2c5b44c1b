"""One stream's live side: Subscriber (its bounded buffer of live events, output chunks and progress), Keepalive (the
process's one timer that wakes the streams quiet for a keep-alive period and ends those past their age), what a
stream's read ends with (Overflow, Closing, Aged) and the status each ends the stream with (`ended`: why, and where
to resume)."""

from __future__ import annotations

import asyncio
import logging
import math
import random
import time
from collections import deque
from collections.abc import Awaitable, Callable
from typing import TypeVar

import grpc
from google.protobuf import duration_pb2
from google.rpc import error_details_pb2

from taskgate import errors, output
from taskgate.waiting import unless
from taskgate_api import reasons
from taskgate_api.v1 import task_pb2

T = TypeVar("T")
log = logging.getLogger("taskgate.notifier.streams")

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

    It has no timer of its own: the process's Keepalive tick wakes it when it has been quiet for a keep-alive period,
    with the newest thing the table has for its key (`newest`). An idle one holds no buffer and no waiter object of
    its own beyond one future (10,000 idle streams: each asyncio.Event and empty deque was 0.8 KiB).
    """

    __slots__ = (
        "_items", "_keepalive", "_loop", "_progress", "_waiter", "capacity", "closing", "ends_at", "key", "newest",
        "overflowed", "quiet_since",
    )

    def __init__(self, key: int | str, capacity: int) -> None:
        self.key = key
        self.capacity = capacity
        self.overflowed = False
        self.closing = False
        self.quiet_since = time.monotonic()  # when the stream last got something to send (an event or a keep-alive)
        self.ends_at = math.inf  # when it ends for its age (Keepalive.add sets it)
        self.newest: int | None = None  # what the last tick's read found for `key` (None: nothing, or it failed)
        self._keepalive = False
        self._items: deque[task_pb2.TaskEvent | output.Live] | None = None  # events and chunks in arrival order
        self._progress: task_pb2.TaskProgress | None = None  # the newest live progress not yet taken (never buffered)
        self._waiter: asyncio.Future[None] | None = None  # what the stream's one reader waits on
        # its loop, asked once: asyncio.get_running_loop() checks the process id with a getpid() system call each
        # time (5% of an idle notifier's CPU, once per keep-alive)
        self._loop = asyncio.get_running_loop()

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
            self._wake()

    def _offer(self, item: task_pb2.TaskEvent | output.Live) -> bool:
        if self.overflowed:
            return False
        if self._items is None:
            self._items = deque()
        if len(self._items) >= self.capacity:
            self.overflowed = True
            self._items = None
        else:
            self._items.append(item)
        self._wake()
        return not self.overflowed

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def _wait(self) -> None:
        """Until the next offer, keep-alive or close (one reader at a time: the stream, or its unless_news)."""
        waiter = self._waiter = self._loop.create_future()
        try:
            await waiter
        finally:
            self._waiter = None

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
            await self._wait()

    def keep_alive(self, newest: int | None = None) -> None:
        """The shared tick: the stream has been quiet for a period, a keep-alive is due; `newest`: what the table has
        for its key (the stream reads what it missed when that is beyond what it sent)."""
        self.newest = newest
        self._keepalive = True
        self._wake()

    def close(self) -> None:
        """Ends the stream at its next read (Closing)."""
        self.closing = True
        self._wake()

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
            # waited here, not in _wait: an idle stream's wait is then this one frame (10,000 of them)
            waiter = self._waiter = self._loop.create_future()
            try:
                await waiter
            finally:
                self._waiter = None
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


NewestRead = Callable[[list[int | str]], Awaitable[dict[int | str, int]]]


class Keepalive:
    """One timer for every stream of the process: each tick (twice a period) finds the streams quiet for a whole period,
    reads for all of them at once the newest thing the table has for each one's key (`newest`: one statement per tick,
    whatever the number of streams), and wakes each with it; so an idle stream costs no timer, no read and no wake-up
    but its keep-alive. A read that fails or takes longer than a period wakes them without it (the keep-alive still goes
    out; the next quiet period reads again)."""

    def __init__(self, seconds: float, max_age: float = math.inf, newest: NewestRead | None = None) -> None:
        self.seconds = seconds
        self.max_age = max_age
        self._newest = newest
        self._subs: set[Subscriber] = set()
        self._timer: asyncio.TimerHandle | None = None
        self._checking: asyncio.Task[None] | None = None  # the tick's read, while it runs
        self._waking: set[Subscriber] = set()  # the streams it reads for

    def add(self, sub: Subscriber) -> None:
        """Starts keeping a stream alive (and the tick, with the first one), until its age ends it (90-100% of
        max_age, so the streams of one connection do not all resume at once)."""
        sub.ends_at = time.monotonic() + self.max_age * random.uniform(0.9, 1.0)
        self._subs.add(sub)
        if self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(self.seconds / 2, self._tick)

    def discard(self, sub: Subscriber) -> None:
        """Stops keeping a stream alive (and the tick and its read, with the last one)."""
        self._subs.discard(sub)
        self._waking.discard(sub)
        if not self._subs:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
            if self._checking is not None:
                self._checking.cancel()

    def _tick(self) -> None:
        self._timer = asyncio.get_running_loop().call_later(self.seconds / 2, self._tick)
        if self._checking is not None:  # the last tick's read still runs: its streams are woken when it ends
            return
        now = time.monotonic()
        quiet = now - self.seconds
        due = [sub for sub in self._subs if sub.quiet_since <= quiet or sub.ends_at <= now]
        if not due:
            return
        if self._newest is None:
            for sub in due:
                sub.keep_alive()
            return
        self._waking = set(due)
        self._checking = asyncio.get_running_loop().create_task(self._check(quiet), name="notifier-keepalive")

    async def _check(self, quiet: float) -> None:
        """The newest of every due stream's key in one read, then each stream woken with its own."""
        found: dict[int | str, int] = {}
        assert self._newest is not None
        try:
            async with asyncio.timeout(self.seconds):
                found = await self._newest(list({sub.key for sub in self._waking}))
        except Exception:  # whatever it was, the keep-alives go out and the next quiet period reads again
            log.warning("quiet streams' check of the event table failed", exc_info=True)
        finally:  # woken even when cancelled: no stream waits on a read that will never end
            waking, self._waking, self._checking = self._waking, set(), None
            now = time.monotonic()
            for sub in waking:
                if sub.quiet_since <= quiet or sub.ends_at <= now:  # not one that has sent something since
                    sub.keep_alive(found.get(sub.key))


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
