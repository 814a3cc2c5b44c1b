"""Rows for tests, inserted by the store function that also inserts the submit service's tasks."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import asyncpg
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message
from hypothesis import strategies as st

from taskgate import auth, ids, store
from taskgate import bus as busmod
from taskgate.config import ModelSpec, Settings
from taskgate.model import TaskRow
from taskgate.runtime import Backends
from taskgate.states import Priority, Status
from taskgate.store import CancelMode, Change, Conn, Move, ResultRef, TaskError, submissions, workers
from taskgate.wire import dispatch
from tests.support import sleepy

Metadata = tuple[tuple[str, str], ...]
MEM_RESULT = store.ResultRef("mem://x", "video/mp4", 10, "ab" * 32)  # a result no store holds
RESULT = store.ResultRef(uri="nats-os://taskgate-results/x.mp4", content_type="video/mp4", size=1234, sha256="ab" * 32)

# What PostgreSQL cannot store: U+0000 and lone surrogates (a client in another language can send the latter as bytes).
UNSTORABLE_CHAR: st.SearchStrategy[str] = st.one_of(
    st.sampled_from(["\x00", "\ud800", "\udbff", "\udc00", "\udfff"]),
    st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF),
)
# Any character, surrogates included (hypothesis leaves them out by default).
ANY_CHAR: st.SearchStrategy[str] = st.characters(exclude_categories=[])


def unstorable_text(max_size: int = 20) -> st.SearchStrategy[str]:
    """Text holding at least one U+0000 or lone surrogate somewhere among any other characters."""
    part = st.text(ANY_CHAR, max_size=max_size)
    return st.tuples(part, UNSTORABLE_CHAR, part).map("".join)


def any_text(max_size: int = 60, *, surrogates: bool = True) -> st.SearchStrategy[str]:
    """Any text, U+0000 included, and lone surrogates unless the caller must build a protobuf message from it."""
    if surrogates:
        return st.one_of(st.text(ANY_CHAR, max_size=max_size), unstorable_text(max_size // 2))
    nul = st.tuples(st.text(max_size=max_size // 2), st.text(max_size=max_size // 2)).map("\x00".join)
    return st.one_of(st.text(max_size=max_size), nul)


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        low, value = value & 0x7F, value >> 7
        out.append(low | (0x80 if value else 0))
        if not value:
            return bytes(out)


def wire_field(number: int, data: bytes) -> bytes:
    """One length-delimited protobuf field (a string, a message or a map entry) holding `data`."""
    return _varint(number << 3 | 2) + _varint(len(data)) + data


def wire_text(value: str) -> bytes:
    """`value` as UTF-8 with lone surrogates kept as their three bytes: what the protobuf library refuses to send."""
    return value.encode("utf-8", "surrogatepass")


async def insert_task(
    db: Conn,
    *,
    user_id: str = "tenant-a",
    model_id: str = "wan-tiny",
    prompt: str = "a red fox in the snow",
    priority: int = 5,
    callback_url: str | None = None,
    params: dict[str, Any] | None = None,
    max_retries: int = 3,
    end_user: str = "",
    task_type: str = "text-to-video",
) -> TaskRow:
    payload = params or {"num_frames": 9, "width": 32, "height": 32, "num_inference_steps": 2,
                         "guidance_scale": 5.0, "fps": 8, "seed": 1, "negative_prompt": ""}
    task_id = ids.new_id()
    digest = hashlib.sha256(json.dumps([user_id, model_id, prompt, payload], sort_keys=True).encode()).hexdigest()
    task = await submissions.create(
        db,
        submissions.NewTask(
            id=task_id, user_id=user_id, idempotency_key=f"k-{task_id}", key_derived=False, request_hash=digest,
            task_type=task_type, model_id=model_id, prompt=prompt, payload=payload, metadata={}, priority=priority,
            max_retries=max_retries, callback_url=callback_url, callback_events=[], end_user=end_user,
        ),
    )
    assert task is not None
    return task


async def claim(
    db: Conn, task_id: int, *, worker_id: str = "w1", lease_seconds: float = 30.0, max_worker_losses: int | None = None
) -> workers.WorkerClaim:
    """The real claim (worker_claim, as a worker runs it, no cap) for a dispatch message naming `task_id`: the fairest
    due QUEUED task of its level, else `task_id` itself while CREATED, or a takeover of it under a lapsed lease."""
    task = await store.get_task(db, task_id)
    return await workers.claim_for(
        db, task_id, model_id=task.model_id if task is not None else "", cap=0, worker_id=worker_id,
        lease_seconds=lease_seconds, actor="worker", reason="claimed", max_worker_losses=max_worker_losses,
    )


async def claimed(db: Conn, task_id: int, **kwargs: Any) -> TaskRow:
    """`task_id` claimed through the real claim (as `claim` takes `kwargs`); the test fails when another task or none
    was."""
    got = await claim(db, task_id, **kwargs)
    assert got.verdict is workers.Verdict.CLAIMED and got.task is not None and got.task.id == task_id, got
    return got.task


@dataclass(frozen=True, slots=True)
class Claim:
    """A worker's claim as one step of a path of moves (`moved`), made through the real claim."""

    worker_id: str = "w1"
    lease_seconds: float = 30.0


Step = store.Change | Claim


async def moved(db: Conn, task_id: int, step: Step, *, actor: str = "test") -> store.Outcome:
    """One step of a path: a guarded move (store.apply), or a Claim through the real claim (`claimed`)."""
    if isinstance(step, Claim):
        before = await store.get_task(db, task_id)
        task = await claimed(db, task_id, worker_id=step.worker_id, lease_seconds=step.lease_seconds)
        return store.Outcome(task=task, from_status=before.status if before is not None else None)
    return await store.apply(db, task_id, step, actor=actor)


async def key_for(backends: Backends, tenant: str = "tenant-a", **limits: Any) -> Metadata:
    """Call metadata carrying a fresh API key of `tenant` (limits as taskgate.auth.create_key takes them)."""
    key, _ = await auth.create_key(backends.pool, backends.settings.api_key_pepper, tenant, **limits)
    return (("authorization", f"Bearer {key}"),)


# ---------------------------------------------------------------- any protobuf message, from its descriptor


_INT_RANGES = {
    FieldDescriptor.TYPE_INT32: (-(2**31), 2**31 - 1), FieldDescriptor.TYPE_SINT32: (-(2**31), 2**31 - 1),
    FieldDescriptor.TYPE_SFIXED32: (-(2**31), 2**31 - 1), FieldDescriptor.TYPE_UINT32: (0, 2**32 - 1),
    FieldDescriptor.TYPE_FIXED32: (0, 2**32 - 1), FieldDescriptor.TYPE_INT64: (-(2**63), 2**63 - 1),
    FieldDescriptor.TYPE_SINT64: (-(2**63), 2**63 - 1), FieldDescriptor.TYPE_SFIXED64: (-(2**63), 2**63 - 1),
    FieldDescriptor.TYPE_UINT64: (0, 2**64 - 1), FieldDescriptor.TYPE_FIXED64: (0, 2**64 - 1),
}
# strings that reach deeper than random text: ids at and past the int64 edge, cursors, times, statuses
_PROBES = [
    "",
    "0",
    "1",
    "-1",
    "9223372036854775807",
    "9223372036854775808",
    "99999999999999999999",
    "1e3",
    " 1",
    "wan-tiny",
    "sleepy",
    "text-to-video",
    "image-to-video",
    "SUCCEEDED",
    "https://example.com/x.png",
    "eyJjIjowfQ",
]


def _int_edges(low: int, high: int) -> st.SearchStrategy[int]:
    return st.one_of(
        st.integers(low, high), st.sampled_from(sorted({low, high, 0, 1, -1 if low < 0 else 0, low + 1, high - 1}))
    )


def _value(field: Any, depth: int) -> st.SearchStrategy[Any]:
    """Any value of one field (a FieldDescriptor, from the pure-Python or the upb implementation)."""
    if field.message_type is not None:
        return proto_messages(field.message_type._concrete_class, depth + 1)
    if field.enum_type is not None:
        return st.one_of(st.sampled_from([v.number for v in field.enum_type.values]), st.integers(-(2**31), 2**31 - 1))
    if field.type in _INT_RANGES:
        return _int_edges(*_INT_RANGES[field.type])
    if field.type in (FieldDescriptor.TYPE_FLOAT, FieldDescriptor.TYPE_DOUBLE):
        return st.floats(width=32 if field.type == FieldDescriptor.TYPE_FLOAT else 64)
    if field.type == FieldDescriptor.TYPE_BOOL:
        return st.booleans()
    if field.type == FieldDescriptor.TYPE_BYTES:
        return st.binary(max_size=64)
    return st.one_of(st.sampled_from(_PROBES), any_text(40, surrogates=False))


def proto_messages(cls: type[Message], depth: int = 0) -> st.SearchStrategy[Message]:
    """Any message of `cls`: each field unset or set to any value its type can carry (ints to their edges, enums past
    their names, timestamps in any year, strings that look like ids and cursors), nested messages to a few levels."""
    descriptor = cls.DESCRIPTOR
    if descriptor.full_name == "google.protobuf.Timestamp":
        return st.builds(
            lambda s, n: cls(seconds=s, nanos=n), _int_edges(-(2**40), 2**40), _int_edges(-(2**31), 2**31 - 1)
        )
    if descriptor.full_name == "google.protobuf.Duration":
        return st.builds(
            lambda s, n: cls(seconds=s, nanos=n), _int_edges(-(2**40), 2**40), st.integers(-999_999_999, 999_999_999)
        )
    fields: dict[str, st.SearchStrategy[Any]] = {}
    for field in descriptor.fields:
        if depth >= 3 and field.message_type is not None:
            continue
        value = _value(field, depth)
        if field.message_type is not None and field.message_type.GetOptions().map_entry:
            key, item = field.message_type.fields_by_name["key"], field.message_type.fields_by_name["value"]
            fields[field.name] = st.dictionaries(_value(key, depth), _value(item, depth), max_size=3)
        elif field.is_repeated:
            fields[field.name] = st.lists(value, max_size=3)
        else:
            fields[field.name] = value

    @st.composite
    def build(draw: st.DrawFn) -> Message:
        message = cls()
        for name in draw(st.lists(st.sampled_from(sorted(fields)), unique=True)) if fields else []:
            field = descriptor.fields_by_name[name]
            value = draw(fields[name])
            if field.message_type is not None and field.message_type.GetOptions().map_entry:
                target = getattr(message, name)
                for k, v in value.items():
                    if isinstance(v, Message):
                        target[k].CopyFrom(v)
                    else:
                        target[k] = v
            elif field.is_repeated:
                getattr(message, name).extend(value)
            elif field.message_type is not None:
                getattr(message, name).CopyFrom(value)
            else:
                setattr(message, name, value)
        return message

    return build()


SLEEPY = "sleepy"


def all_settings(backends: Backends) -> Settings:
    """Every setting the test's backends were connected with (Backends types them as the common group only)."""
    assert isinstance(backends.settings, Settings)
    return backends.settings


def sleepy_settings(settings: Settings, sleep: float = 0.0, **spec: Any) -> Settings:
    """Settings for a worker serving only the 'sleep' model (`spec`: its ModelSpec fields and faults, see
    tests/support/sleepy.py), with short leases."""
    models = dict(settings.models)
    models[SLEEPY] = sleepy.spec(sleep, **spec)
    return settings.model_copy(
        update={
            "models": models,
            "worker_models": [SLEEPY],
            "worker_slots": 1,
            "lease_seconds": 2.0,
            "heartbeat_seconds": 0.5,
            "progress_interval_seconds": 0.0,
            "drain_grace_seconds": 0.0,
            "worker_cap_retry_seconds": 0.1,
        }
    )


def with_(settings: Settings, **update: Any) -> Settings:
    return settings.model_copy(update=update)


async def submit(
    backends: Backends,
    *,
    model: str = SLEEPY,
    priority: int = Priority.NORMAL,
    params: dict[str, Any] | None = None,
    queue: bool = True,
    **kwargs: Any,
) -> TaskRow:
    """Inserts a task and publishes its dispatch message the way the submit service does."""
    task = await insert_task(backends.pool, model_id=model, priority=priority, params=params, **kwargs)
    await publish(backends, task, f"{task.id}.q0")
    if queue:
        out = await store.queue(backends.pool, task.id, actor="submit")
        assert out.applied or out.task is not None
    return task


async def publish(backends: Backends, task: TaskRow, msg_id: str) -> None:
    """The task's dispatch message under a chosen message id (a test's replay or re-publish)."""
    await backends.bus.js.publish(
        busmod.task_subject(task.model_id, task.priority), dispatch.encode(task), headers={"Nats-Msg-Id": msg_id}
    )


def params(steps: int = 4, seed: int = 1, **extra: Any) -> dict[str, Any]:
    base = {
        "num_frames": 9,
        "width": 32,
        "height": 32,
        "num_inference_steps": steps,
        "guidance_scale": 5.0,
        "fps": 8,
        "seed": seed,
        "negative_prompt": "",
    }
    base.update(extra)
    return base


async def put_in(
    pool: asyncpg.Pool, status: Status, *, model_id: str = "wan-tiny", lease: float = 10.0, worker: str = "w1",
    max_retries: int = 3,
) -> TaskRow:
    """A task driven to `status` through legal moves; PROCESSING ones hold a lease of `lease` seconds."""
    task = await insert_task(pool, model_id=model_id, max_retries=max_retries)
    claim = Claim(worker, lease)
    path: dict[Status, list[Step]] = {
        Status.CREATED: [],
        Status.QUEUED: [store.Queue()],
        Status.PROCESSING: [store.Queue(), claim],
        Status.SUCCEEDED: [store.Queue(), claim, store.Succeed(MEM_RESULT)],
        Status.FAILED: [store.Queue(), claim, store.Fail(store.TaskError("BOOM", "it broke"))],
        Status.CANCELED: [store.Cancel(store.CancelMode.SOFT)],
    }
    for change in path[status]:
        out = await moved(pool, task.id, change)
        assert out.applied and out.task is not None, (status, change, out.rejection)
        task = out.task
    return task


async def dead(pool: asyncpg.Pool, status: Status, **task: Any) -> TaskRow:
    """A task ended FAILED (retries exhausted, from PROCESSING) or TIMEOUT (from QUEUED), with its dead letter."""
    source = await insert_task(pool, **task)
    moves: list[Step] = [store.Queue()] if status is Status.TIMEOUT else [store.Queue(), Claim("w1", 10.0)]
    for change in moves:
        assert (await moved(pool, source.id, change)).applied
    error = store.TaskError("QUEUE_TIMEOUT" if status is Status.TIMEOUT else "MODEL_CRASHED", "it broke")
    if status is Status.TIMEOUT:
        out = await store.time_out(pool, source.id, error=error, actor="scheduler", reason="queued too long")
    else:
        out = await store.fail(pool, source.id, error=error, actor="w1", reason="retries exhausted", dead_letter=True)
    assert out.applied and out.task is not None and out.task.status is status
    return out.task


async def finished_runs(pool: Any, seconds: Sequence[float], **fields: Any) -> None:
    """Successful runs of the model that took `seconds` each, from start to finish."""
    for run in seconds:  # in a level of their own (LOW): the claim takes them, not the test's queued NORMAL tasks
        task_id = await queued(pool, **{"priority": Priority.LOW, **fields})
        await claimed(pool, task_id, worker_id="w-history", lease_seconds=30.0)
        assert (await store.apply(pool, task_id, store.Succeed(RESULT), actor="test")).applied
        await pool.execute(
            "UPDATE task SET started_at = finished_at - make_interval(secs => $2) WHERE id = $1", task_id, run
        )




async def queued(pool: Any, **fields: Any) -> int:
    task = await insert_task(pool, **fields)
    assert (await store.queue(pool, task.id, actor="test")).applied
    return task.id


def settings_for(state_dir: Path, *, database_url: str | None = None, nats_url: str | None = None) -> Settings:
    """Settings for one test: ephemeral ports, the tiny Wan model under `state_dir` and the 'sleep' model, callbacks
    allowed to 127.0.0.1; the `settings` fixture adds the test's database and streams."""
    return Settings(
        database_url=database_url,
        nats_url=nats_url,
        state_dir=state_dir,
        submit_port=0,
        notifier_port=0,
        scheduler_port=0,
        worker_port=0,
        submit_metrics_port=0,
        notifier_metrics_port=0,
        scheduler_metrics_port=0,
        worker_metrics_port=0,
        callback_allow_hosts=["127.0.0.1"],
        # each call reads the queue as it finds it (tests of the shared snapshot set a period)
        eta_snapshot_seconds=0.0,
        # the suite's own calls come in bursts (the call-limit tests set theirs)
        tenant_calls_per_second=200.0,
        tenant_calls_burst=400,
        models={"wan-tiny": ModelSpec(path=state_dir / "models" / "wan-tiny"), "sleepy": ModelSpec(kind="sleep")},
    )


CHANGES: dict[Move, Change] = {
    Move.QUEUE: store.Queue(),
    Move.REPUBLISH: store.Republish(),
    Move.PROGRESS: store.Progress(50, 10.0),
    Move.SUCCEED: store.Succeed(ResultRef("mem://y", "video/mp4", 5, "cd" * 32)),
    Move.FAIL: store.Fail(TaskError("E", "x")),
    Move.RETRY: store.Retry(TaskError("E", "x"), 1.0),
    Move.RELEASE: store.Release(),
    Move.CANCEL: store.Cancel(CancelMode.HARD),
    Move.TIMEOUT: store.TimeOut(TaskError("T", "x")),
}
