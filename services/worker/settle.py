"""What happens next to an attempt and its message: one pure decision from the task row and what the run did.

Every path that reads the row's state goes through `decide`: a look while the run goes on (a cancel signal, a refused
lease renewal or progress write) and the answer to each final write (succeed, retry, fail, release). A final write
whose first try committed but whose reply was lost is refused when retried, yet the row shows it: the row decides.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from services.worker.retry import PermanentError, RetryableError
from taskgate.model import TaskRow
from taskgate.states import Status
from taskgate.store import CancelMode


class MessageAction(enum.Enum):
    """What is done with the dispatch message."""

    ACK = "ack"  # this message needs no further run
    NAK = "nak"  # redeliver it (after the step's delay): the task is queued again
    TERM = "term"  # never redeliver it: it names no task
    KEEP_REUSABLE = "keep_reusable"  # keep the run's output for an identical request (then ack), or let the run finish
    NOTHING = "nothing"  # leave it: a newer attempt's worker owns it, or the run goes on


class Fate(enum.StrEnum):
    """How this worker's handling of one message ended, as reports and logs say."""

    SUCCEEDED = "succeeded"
    REUSED = "reused"  # succeeded with an earlier soft-cancelled run's output
    SOFT_CANCELED = "soft_canceled"  # cancelled while running; the output is kept for reuse
    RETRIED = "retried"
    DEAD = "dead"  # failed for good after its retries, dead-lettered
    FAILED = "failed"
    RELEASED = "released"  # handed back while draining
    REQUEUED = "requeued"  # queued again elsewhere while it ran
    CANCELED = "canceled"
    TERMINAL = "terminal"  # ended elsewhere (timed out, failed)
    LOST = "lost"  # another attempt took the task while this one ran
    FENCED = "fenced"  # another attempt took the task before this one's final write
    GONE = "gone"  # the task row no longer exists
    REFUSED = "refused"  # not run: no such task, another model's, finished, or its claim refused
    CAPPED = "capped"  # not run now: its model's concurrency cap is reached
    WAITING = "waiting"  # not run now: nothing in its level is due yet, or every due task is being claimed


@dataclass(frozen=True, slots=True)
class Step:
    """What happens next: the message's action, how the handling ended (None: it has not), the nak's delay."""

    action: MessageAction
    fate: Fate | None
    delay: float | None = None
    error_code: str | None = None


@dataclass(frozen=True, slots=True)
class Running:
    """The run goes on; something asked for a look at the row."""


@dataclass(frozen=True, slots=True)
class Produced:
    """The run has an output and asked SUCCEED with it."""

    uri: str
    reused: bool = False  # an earlier soft-cancelled run's output, not this run's own
    keepable: bool = True  # False once keeping it for reuse was refused


@dataclass(frozen=True, slots=True)
class Released:
    """This worker is draining and asked RELEASE."""


RunOutcome = Running | Produced | RetryableError | PermanentError | Released


def decide(row: TaskRow | None, *, attempt: int, run: RunOutcome) -> Step:
    """What happens next, from the task row as the database now says and what attempt `attempt` did."""
    running = isinstance(run, Running)
    if row is None or row.attempt != attempt:
        if running:
            return Step(MessageAction.NOTHING, Fate.LOST)  # the message belongs to whoever holds the task now
        return Step(MessageAction.ACK, Fate.GONE) if row is None else Step(MessageAction.NOTHING, Fate.FENCED)
    written = _written(row, run)
    if written is not None:
        return written
    if row.status is Status.CANCELED and row.cancel_mode == CancelMode.SOFT:
        if running:
            return Step(MessageAction.KEEP_REUSABLE, None)  # finish: the output becomes reusable
        if isinstance(run, Produced) and run.keepable and not run.reused:
            return Step(MessageAction.KEEP_REUSABLE, Fate.SOFT_CANCELED)
    if row.status.terminal:
        return Step(MessageAction.ACK, Fate.CANCELED if row.status is Status.CANCELED else Fate.TERMINAL)
    if row.status is Status.PROCESSING:
        return Step(MessageAction.NOTHING, None if running else Fate.REFUSED)
    return Step(MessageAction.NAK, Fate.REQUEUED)


def _written(row: TaskRow, run: RunOutcome) -> Step | None:
    """The step when the row (of this attempt) shows the final write the run asked for, else None."""
    if isinstance(run, Produced) and row.status is Status.SUCCEEDED and row.result_uri == run.uri:
        return Step(MessageAction.ACK, Fate.REUSED if run.reused else Fate.SUCCEEDED)
    if isinstance(run, RetryableError) and row.status is Status.QUEUED and row.retry_count == run.retry:
        return Step(MessageAction.NAK, Fate.RETRIED, delay=run.delay, error_code=run.code)
    if isinstance(run, PermanentError) and row.status is Status.FAILED and row.error_code == run.code:
        return Step(MessageAction.ACK, Fate.DEAD if run.dead_letter else Fate.FAILED, error_code=run.code)
    if isinstance(run, Released) and row.status is Status.QUEUED:
        return Step(MessageAction.NAK, Fate.RELEASED)
    return None
