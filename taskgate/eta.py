"""Queue position and ETA under the real dispatch order: when a task should start and finish, from recent history.

The order is the one the workers follow: inside its (model, priority) level a QUEUED task waits for the turns fair
share gives it (the level's `level_position`), and the levels of its model share the model's slots by the workers'
fetch weights (HIGH:NORMAL:LOW, 6:3:1 by default) while each has tasks; a level that empties hands its share to the
rest. The model's slots are the live workers' slots, a worker serving several models sharing its slots among them by
the weights of their levels with QUEUED tasks (never credited whole to each). The position is how many claims of the
model come up to and including the task; it starts after position x run time / slots, and finishes one run time
later. A PROCESSING task finishes after the part of a run time its progress has not covered. Without recent
successful runs of that model and size class, or without live workers for a queued task, there is no estimate: the
fields stay unset.

A chat task's run time is its expected output tokens times its model's measured seconds per output token (the median
over recent runs of a run's seconds over its output tokens): the expected tokens are the recent runs' mean output
tokens, at most the task's own max_output_tokens. A running chat task's progress is its generated tokens over its
max_output_tokens: it finishes after the expected tokens it has not generated yet, or, once its answer is longer than
expected, after those left to its limit. A video's run time is the median run of its size class.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta

from taskgate.config import CommonSettings
from taskgate.model import set_timestamp
from taskgate.states import Priority, Status
from taskgate.store import Conn
from taskgate.store.estimates import EtaInputs, eta_inputs
from taskgate_api.v1 import task_pb2


@dataclass(frozen=True, slots=True)
class Estimate:
    """A task's queue position and ETA as of one read of the database (`status`: the task's state then)."""

    status: Status
    queue_position: int
    start: datetime | None = None
    finish: datetime | None = None

    def stamp(self, msg: task_pb2.Task | task_pb2.TaskEvent) -> None:
        """Sets estimated_start and estimated_finish on a message, each when known."""
        if self.start is not None:
            set_timestamp(msg.estimated_start, self.start)
        if self.finish is not None:
            set_timestamp(msg.estimated_finish, self.finish)


def estimate(inputs: EtaInputs, *, cap: int = 0, weights: tuple[int, int, int] = (6, 3, 1)) -> Estimate:
    """The estimate the inputs support; `cap`: the model's concurrency cap across workers (0: none); `weights`: the
    workers' fetch weights of HIGH, NORMAL and LOW."""
    if inputs.status is Status.QUEUED:
        claims, position = place(inputs, weights)
        run = run_seconds(inputs)
        slots = min(inputs.slots, cap) if cap > 0 else inputs.slots
        if run is None or slots <= 0:  # no history, or nothing serves the model now: no honest start time
            return Estimate(inputs.status, position)
        start = inputs.now + timedelta(seconds=claims * run / slots)
        return Estimate(inputs.status, position, start, start + timedelta(seconds=run))
    if inputs.status is Status.PROCESSING and (run := run_seconds(inputs)) is not None:
        done = min(max(inputs.progress, 0), 100) / 100
        left = run * (1 - done)
        if inputs.max_output_tokens is not None and inputs.token_seconds is not None:
            left = _chat_left(inputs.max_output_tokens, done, run / inputs.token_seconds) * inputs.token_seconds
        return Estimate(inputs.status, 0, None, inputs.now + timedelta(seconds=left))
    return Estimate(inputs.status, 0)


def _chat_left(max_tokens: int, done: float, expected: float) -> float:
    """The tokens a running chat task is expected to generate still: its progress is its generated tokens over its
    max_output_tokens; short of the expected answer, the rest of it; past it, up to its limit."""
    generated = done * max_tokens
    return expected - generated if generated < expected else max_tokens - generated


def run_seconds(inputs: EtaInputs) -> float | None:
    """The seconds a task is expected to run (None: no history to say): a chat task's expected output tokens (the
    recent mean, at most its max_output_tokens) times the measured seconds per output token; any other task's median
    run of its size class."""
    if inputs.max_output_tokens is None:
        return inputs.run_seconds
    if inputs.token_seconds is None:
        return None
    tokens = float(inputs.max_output_tokens)
    if inputs.mean_output_tokens is not None:
        tokens = min(tokens, inputs.mean_output_tokens)
    return tokens * inputs.token_seconds


SIMULATED = 20_000  # claims simulated one by one; beyond, the levels' shares are followed as rates


def place(inputs: EtaInputs, weights: tuple[int, int, int]) -> tuple[float, int]:
    """How many of its model's claims come up to and including a QUEUED task's (its position, and the claims that
    take time): the workers' smooth weighted round robin over the levels that still have tasks, claim by claim (as
    services/worker/consumer.py Weighted picks, a level that empties losing its credit), or as rates when long.

    The round robin repeats itself: once the credits at the end of a round (a round: the weights' sum of claims) are
    ones already seen since the last level emptied, every round until a level runs short takes the same claims, so
    those rounds are skipped whole — the answer is the claim-by-claim one, at a cost that does not grow with the
    position (one GetTask of a task 1,000 deep simulated 1,000 claims, ~2 ms of Python)."""
    by_priority = {Priority.HIGH: weights[0], Priority.NORMAL: weights[1], Priority.LOW: weights[2]}
    mine = inputs.priority
    target = max(inputs.level_position, 1)
    left = {p: n for p, n in inputs.queued.items() if n > 0 and p != mine}
    left[mine] = target
    if sum(left.values()) > SIMULATED:
        return _as_rates(left, mine, by_priority)
    credit = dict.fromkeys(left, 0)
    claims = 0
    seen: dict[tuple[int, ...], tuple[int, dict[int, int]]] = {}  # credits at a round's end -> claims, tasks left then
    while True:
        total = sum(max(1, by_priority[p]) for p in left)
        emptied = False
        for _ in range(total):
            for p in left:
                credit[p] += max(1, by_priority[p])
            best = max(left, key=lambda p: (credit[p], p))
            credit[best] -= total
            claims += 1
            left[best] -= 1
            if best == mine and left[best] == 0:
                return float(claims), claims
            if left[best] == 0:
                del left[best], credit[best]
                emptied = True
                break
        if emptied:
            seen.clear()  # fewer levels: a new round robin
            continue
        state = tuple(credit.values())
        if state in seen:  # a cycle: skip as many of them as leave every level a task
            then, was = seen[state]
            taken = {p: was[p] - left[p] for p in left}
            cycles = min((left[p] - 1) // taken[p] for p in left if taken[p] > 0)
            claims += cycles * (claims - then)
            for p in left:
                left[p] -= cycles * taken[p]
            seen.clear()
        seen[state] = (claims, dict(left))


def _as_rates(left: dict[int, int], priority: int, by_priority: dict[int, int]) -> tuple[float, int]:
    """`place` for long queues: each level served at its weight's share of the claims while it has tasks."""
    rest = {p: float(n) for p, n in left.items()}
    elapsed = 0.0
    while rest.get(priority, 0.0) > 1e-9:
        share = sum(max(1, by_priority[p]) for p in rest)
        rates = {p: max(1, by_priority[p]) / share for p in rest}
        step = min(n / rates[p] for p, n in rest.items())
        elapsed += step
        rest = {p: n - rates[p] * step for p, n in rest.items() if n - rates[p] * step > 1e-9}
    return elapsed, round(elapsed)


async def estimates(
    db: Conn, task_ids: Collection[int], settings: CommonSettings, *, within: float | None = None
) -> dict[int, Estimate]:
    """Each task's estimate by id, in one statement; a missing task is absent."""
    found = await eta_inputs(
        db,
        task_ids,
        window_seconds=settings.eta_history_seconds,
        max_runs=settings.eta_history_runs,
        alive_seconds=settings.lease_seconds,
        weights=settings.priority_weights,
        within=within,
    )
    out = {}
    for task_id, inputs in found.items():
        spec = settings.models.get(inputs.model_id)
        out[task_id] = estimate(inputs, cap=spec.max_concurrency if spec else 0, weights=settings.priority_weights)
    return out


ESTIMATED = frozenset({Status.QUEUED, Status.PROCESSING})  # the states whose tasks carry a position and an ETA


async def current(
    db: Conn, task_id: int, status: Status, settings: CommonSettings, *, within: float | None = None
) -> Estimate | None:
    """The estimate of a task seen in `status`, while it is still there: None for a state without one (not QUEUED or
    PROCESSING) and for a task that has moved on since it was seen."""
    return (await current_many(db, [(task_id, status)], settings, within=within))[0]


async def current_many(
    db: Conn, seen: Sequence[tuple[int, Status]], settings: CommonSettings, *, within: float | None = None
) -> list[Estimate | None]:
    """`current` of each (task id, status) seen, in order, in one statement (none when no state has an estimate)."""
    wanted = {task_id for task_id, status in seen if status in ESTIMATED}
    found = await estimates(db, wanted, settings, within=within) if wanted else {}
    return [e if (e := found.get(task_id)) is not None and e.status is status else None for task_id, status in seen]
