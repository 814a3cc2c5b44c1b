"""The worker's pure decisions: settle's step from (task row, run outcome), and the retry policy's typed errors."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import pytest

from services.worker.retry import PermanentError, RetryableError, failure_of
from services.worker.settle import Fate, MessageAction, Produced, Released, Running, RunOutcome, Step, decide
from taskgate.config import Settings
from taskgate.model import TaskRow
from taskgate.states import Status
from tests.support.sleepy import InjectedFailure

ATTEMPT = 2
URI = "nats-os://results/7-a2.json"
NOW = datetime(2025, 1, 1, tzinfo=UTC)


def row(status: Status, *, attempt: int = ATTEMPT, **fields: Any) -> TaskRow:
    """A task row as the database would return it after this attempt (2) was claimed."""
    base: dict[str, Any] = {
        "id": 7,
        "user_id": "tenant-a",
        "idempotency_key": "k",
        "request_hash": "h",
        "task_type": "text-to-video",
        "model_id": "sleepy",
        "prompt": "p",
        "request_payload": {},
        "priority": 5,
        "queue_name": "sleepy",
        "status": status,
        "progress": 0,
        "version": 5,
        "attempt": attempt,
        "retry_count": 1,
        "max_retries": 3,
        "created_at": NOW,
        "updated_at": NOW,
    }
    return TaskRow(**(base | fields))


RETRY = RetryableError("TRANSIENT_IO", "io", delay=0.75, retry=2)  # the task's second retry: retry_count 1 -> 2
DEAD = PermanentError("TRANSIENT_IO", "io", dead_letter=True)
FAIL = PermanentError("INVALID_PARAMETERS", "bad", dead_letter=False)
FRESH = Produced(URI)
REUSED = Produced(URI, reused=True)
ENDED_ELSEWHERE = (Status.TIMEOUT, Status.FAILED, Status.SUCCEEDED)
ALL_OUTCOMES: list[RunOutcome] = [
    Running(),
    FRESH,
    REUSED,
    Produced(URI, keepable=False),
    RETRY,
    DEAD,
    FAIL,
    Released(),
]


# ---- while the run goes on ----


def test_a_running_attempt_that_still_holds_the_task_goes_on() -> None:
    assert decide(row(Status.PROCESSING), attempt=ATTEMPT, run=Running()) == Step(MessageAction.NOTHING, None)


@pytest.mark.parametrize("current", [None, row(Status.PROCESSING, attempt=3), row(Status.QUEUED, attempt=1)])
def test_a_running_attempt_whose_task_another_holds_stops_and_leaves_the_message(current: TaskRow | None) -> None:
    assert decide(current, attempt=ATTEMPT, run=Running()) == Step(MessageAction.NOTHING, Fate.LOST)


def test_a_soft_cancel_lets_the_run_finish_for_reuse() -> None:
    current = row(Status.CANCELED, cancel_mode="soft")
    assert decide(current, attempt=ATTEMPT, run=Running()) == Step(MessageAction.KEEP_REUSABLE, None)


def test_a_hard_cancel_stops_the_run_and_acks() -> None:
    current = row(Status.CANCELED, cancel_mode="hard")
    assert decide(current, attempt=ATTEMPT, run=Running()) == Step(MessageAction.ACK, Fate.CANCELED)


@pytest.mark.parametrize("status", ENDED_ELSEWHERE)
def test_a_task_ended_elsewhere_stops_the_run_and_acks(status: Status) -> None:
    assert decide(row(status), attempt=ATTEMPT, run=Running()) == Step(MessageAction.ACK, Fate.TERMINAL)


def test_a_task_requeued_while_it_ran_stops_the_run_and_naks() -> None:
    assert decide(row(Status.QUEUED), attempt=ATTEMPT, run=Running()) == Step(MessageAction.NAK, Fate.REQUEUED)


# ---- after a final write: the row shows the write (applied, or committed before its reply was lost) ----


def test_the_succeed_written_acks() -> None:
    done = row(Status.SUCCEEDED, result_uri=URI)
    assert decide(done, attempt=ATTEMPT, run=FRESH) == Step(MessageAction.ACK, Fate.SUCCEEDED)
    assert decide(done, attempt=ATTEMPT, run=REUSED) == Step(MessageAction.ACK, Fate.REUSED)


def test_the_retry_written_naks_with_its_delay() -> None:
    queued = row(Status.QUEUED, retry_count=2)
    assert decide(queued, attempt=ATTEMPT, run=RETRY) == Step(
        MessageAction.NAK, Fate.RETRIED, delay=0.75, error_code="TRANSIENT_IO"
    )


def test_the_fail_written_acks_as_dead_or_failed() -> None:
    failed = row(Status.FAILED, error_code="TRANSIENT_IO")
    assert decide(failed, attempt=ATTEMPT, run=DEAD) == Step(MessageAction.ACK, Fate.DEAD, error_code="TRANSIENT_IO")
    failed = row(Status.FAILED, error_code="INVALID_PARAMETERS")
    assert decide(failed, attempt=ATTEMPT, run=FAIL) == Step(
        MessageAction.ACK, Fate.FAILED, error_code="INVALID_PARAMETERS"
    )


def test_the_release_written_naks_at_once() -> None:
    assert decide(row(Status.QUEUED), attempt=ATTEMPT, run=Released()) == Step(MessageAction.NAK, Fate.RELEASED)


# ---- after a refused final write ----


@pytest.mark.parametrize("outcome", ALL_OUTCOMES[1:], ids=repr)
def test_a_write_refused_because_the_row_is_gone_acks(outcome: RunOutcome) -> None:
    assert decide(None, attempt=ATTEMPT, run=outcome) == Step(MessageAction.ACK, Fate.GONE)


@pytest.mark.parametrize("outcome", ALL_OUTCOMES[1:], ids=repr)
@pytest.mark.parametrize("status", [Status.PROCESSING, Status.SUCCEEDED, Status.QUEUED])
def test_a_stale_attempt_is_fenced_and_leaves_the_message_to_the_newer_one(status: Status, outcome: RunOutcome) -> None:
    newer = row(status, attempt=ATTEMPT + 1, result_uri=URI, retry_count=2, error_code="TRANSIENT_IO")
    assert decide(newer, attempt=ATTEMPT, run=outcome) == Step(MessageAction.NOTHING, Fate.FENCED)


def test_a_soft_cancelled_attempts_own_output_is_kept_for_reuse() -> None:
    canceled = row(Status.CANCELED, cancel_mode="soft")
    assert decide(canceled, attempt=ATTEMPT, run=FRESH) == Step(MessageAction.KEEP_REUSABLE, Fate.SOFT_CANCELED)


@pytest.mark.parametrize("outcome", [REUSED, Produced(URI, keepable=False), RETRY, DEAD, FAIL, Released()], ids=repr)
def test_a_soft_cancel_with_no_output_to_keep_acks_as_canceled(outcome: RunOutcome) -> None:
    canceled = row(Status.CANCELED, cancel_mode="soft")
    assert decide(canceled, attempt=ATTEMPT, run=outcome) == Step(MessageAction.ACK, Fate.CANCELED)


@pytest.mark.parametrize("outcome", ALL_OUTCOMES[1:], ids=repr)
def test_a_hard_cancel_after_the_run_acks_as_canceled(outcome: RunOutcome) -> None:
    canceled = row(Status.CANCELED, cancel_mode="hard")
    assert decide(canceled, attempt=ATTEMPT, run=outcome) == Step(MessageAction.ACK, Fate.CANCELED)


@pytest.mark.parametrize("outcome", [FRESH, REUSED, RETRY, Released()], ids=repr)
@pytest.mark.parametrize("status", ENDED_ELSEWHERE)
def test_a_task_ended_elsewhere_acks_as_terminal(status: Status, outcome: RunOutcome) -> None:
    ended = row(status, result_uri="nats-os://results/someone-elses.json", error_code="PROCESSING_TIMEOUT")
    assert decide(ended, attempt=ATTEMPT, run=outcome) == Step(MessageAction.ACK, Fate.TERMINAL)


@pytest.mark.parametrize("outcome", [FRESH, REUSED, DEAD, FAIL], ids=repr)
def test_a_task_requeued_before_the_final_write_naks_at_once(outcome: RunOutcome) -> None:
    assert decide(row(Status.QUEUED), attempt=ATTEMPT, run=outcome) == Step(MessageAction.NAK, Fate.REQUEUED)


def test_a_retry_refused_because_an_operator_requeued_first_naks_without_the_backoff() -> None:
    released = row(Status.QUEUED, retry_count=1)  # the retry count was not bumped: not our RETRY
    assert decide(released, attempt=ATTEMPT, run=RETRY) == Step(MessageAction.NAK, Fate.REQUEUED)


@pytest.mark.parametrize("outcome", ALL_OUTCOMES[1:], ids=repr)
def test_a_write_refused_while_the_attempt_still_runs_changes_nothing(outcome: RunOutcome) -> None:
    assert decide(row(Status.PROCESSING), attempt=ATTEMPT, run=outcome) == Step(MessageAction.NOTHING, Fate.REFUSED)


# ---- the retry policy ----


def policy_settings() -> Settings:
    return Settings(retry_backoff_seconds=1.0, retry_jitter=0.2, retry_backoff_max_seconds=5.0)


def test_a_retryable_failure_with_retries_left_is_retried_after_the_backoff() -> None:
    failure = failure_of(
        InjectedFailure("TRANSIENT_IO", True, 2), task=row(Status.PROCESSING), settings=policy_settings()
    )
    assert isinstance(failure, RetryableError) and (failure.code, failure.retry) == ("TRANSIENT_IO", 2)
    assert 1.6 <= failure.delay <= 2.4  # the second retry: twice the base, jittered
    assert failure.message.startswith("InjectedFailure: ")


def test_a_retryable_failure_without_retries_left_is_dead_lettered() -> None:
    exhausted = row(Status.PROCESSING, retry_count=3)
    failure = failure_of(InjectedFailure("TRANSIENT_IO", True, 4), task=exhausted, settings=policy_settings())
    assert isinstance(failure, PermanentError) and failure.dead_letter and failure.reason == "retries exhausted"


def test_a_permanent_failure_fails_at_once_and_its_message_is_bounded() -> None:
    exc = ValueError("x" * 2000)
    failure = failure_of(exc, task=row(Status.PROCESSING), settings=policy_settings())
    assert isinstance(failure, PermanentError) and not failure.dead_letter and failure.reason == "permanent failure"
    assert len(failure.message) == 500 and failure.error.code == failure.code
