"""A running task's partial output: text deltas, preview frames and log lines, carried by JetStream, not PostgreSQL.

One subject per task (`bus.output_subject`) in the TASK_OUTPUT stream, kept for `output_max_age_seconds`. The worker
publishes chunks (text gathered for `output_coalesce_seconds` into one), each with a Nats-Msg-Id naming its task,
attempt, kind and position, so a repeated publish is stored once; readers (WatchTask, SSE, the SDK) follow a task's
subject from a stream sequence, which is the resume point a client hands back. PostgreSQL stays the truth for the
task's state and its final result; a chunk lost to a crash is made good by the next attempt or the final result.

A text chunk says where it starts in its attempt's text (`offset`): a reader keeps, per attempt, the characters it
has and drops any overlap, so a chunk seen twice never doubles text; a chunk of a newer attempt starts that
attempt's text (from 0, or from where it resumed).

A text chunk of an in-process model also carries, in its `Taskgate-Tokens` header (never in the client's message), the
token ids that made its text and where they start among the attempt's tokens: a later attempt of the task reads the
stream back (`resume_text`) and continues from exactly what readers were sent, with the very tokens that made it.

Reading: the stream republishes each chunk once stored on `bus.output_live_subject` with its sequence and the
previous sequence of its task (`live`), so a reader follows a task with a core subscription, no consumer; it reads
what it missed (before it subscribed, or a gap the previous sequence shows) by sequence with `read_after`.
"""

from __future__ import annotations

from dataclasses import dataclass

from google.protobuf.timestamp_pb2 import Timestamp
from nats.aio.msg import Msg
from nats.js.errors import NotFoundError

from taskgate import bus as busmod
from taskgate import results
from taskgate_api.v1 import task_pb2

TEXT = task_pb2.OUTPUT_KIND_TEXT
PREVIEW = task_pb2.OUTPUT_KIND_PREVIEW
LOG = task_pb2.OUTPUT_KIND_LOG
_KIND_NAMES: dict[int, str] = {TEXT: "text", PREVIEW: "preview", LOG: "log"}


PREVIEWS = "previews/"  # where preview images live in the result store
PREVIEW_TYPES = {"webp": "image/webp", "png": "image/png"}


def kind_name(kind: int) -> str:
    """A chunk kind as webhooks and logs write it: text, preview or log."""
    return _KIND_NAMES.get(kind, "unknown")


def preview_name(task_id: int, attempt: int, step: int, fmt: str) -> str:
    """The result store's name of one preview image: one per task, attempt and step."""
    return f"{PREVIEWS}{task_id}-a{attempt}-s{step}.{fmt}"


def is_preview_of(store: results.ResultStore, task_id: int, uri: str) -> bool:
    """Whether `uri` names a preview image of this task in this store (what GetTaskResult serves as a preview)."""
    prefix = store.uri_of(f"{PREVIEWS}{task_id}-a")
    rest = uri[len(prefix):]
    return uri.startswith(prefix) and "/" not in rest and ".." not in rest and rest.rpartition(".")[2] in PREVIEW_TYPES


def preview_type(uri: str) -> str:
    """A preview image's content type, from its name."""
    return PREVIEW_TYPES.get(uri.rpartition(".")[2], "application/octet-stream")


@dataclass(frozen=True, slots=True)
class Chunk:
    """One piece of partial output as the worker publishes it (`position`: a text chunk's offset, a preview's
    step, a log line's number in its attempt: what makes its message id unique)."""

    task_id: int
    attempt: int
    kind: int
    text: str = ""
    offset: int = 0
    uri: str = ""
    content_type: str = ""
    step: int = 0
    tokens: tuple[int, ...] | None = None  # a text chunk's token ids (None: not known, as from an upstream server)
    token_offset: int = 0  # where they start among the attempt's tokens

    def position(self) -> int:
        return self.step if self.kind == PREVIEW else self.offset


def encode(chunk: Chunk, at: Timestamp | None = None) -> bytes:
    """The OutputChunk message of a chunk (its sequence is the stream's, known only once stored)."""
    msg = task_pb2.OutputChunk(
        task_id=str(chunk.task_id), attempt=chunk.attempt, kind=task_pb2.OutputKind.ValueType(chunk.kind),
        text=chunk.text, offset=chunk.offset, uri=chunk.uri, content_type=chunk.content_type, step=chunk.step,
    )
    if at is None:
        msg.at.GetCurrentTime()
    else:
        msg.at.CopyFrom(at)
    return msg.SerializeToString()


def decode(data: bytes, sequence: int) -> task_pb2.OutputChunk | None:
    """The chunk a stored message holds, with its stream sequence set; None when it is not one."""
    try:
        msg = task_pb2.OutputChunk.FromString(data)
    except Exception:  # protobuf raises DecodeError and, on some inputs, other errors
        return None
    msg.sequence = sequence
    return msg


def message_id(chunk: Chunk) -> str:
    """Nats-Msg-Id: the same chunk published twice inside the duplicate window is stored once."""
    return f"{chunk.task_id}.a{chunk.attempt}.{_KIND_NAMES.get(chunk.kind, 'x')}{chunk.position()}"


async def publish(bus: busmod.Bus, user_id: str, chunk: Chunk) -> int:
    """Stores one chunk on its task's subject and answers its stream sequence (NATS errors are the caller's)."""
    headers = {"Nats-Msg-Id": message_id(chunk)}
    if chunk.tokens is not None:
        headers[TOKENS_HEADER] = f"{chunk.token_offset}:{','.join(map(str, chunk.tokens))}"
    ack = await bus.js.publish(busmod.output_subject(user_id, chunk.task_id), encode(chunk), headers=headers)
    return int(ack.seq)


TOKENS_HEADER = "Taskgate-Tokens"


@dataclass(frozen=True, slots=True)
class Resumable:
    """What a task's output stream says its newest attempt produced: the text its readers were sent and the tokens that
    made it (from `attempt`)."""

    attempt: int
    text: str
    tokens: list[int]


def _tokens_of(headers: dict[str, str] | None) -> tuple[int, list[int]] | None:
    value = (headers or {}).get(TOKENS_HEADER)
    if value is None:
        return None
    offset, _, ids = value.partition(":")
    try:
        return int(offset), [int(t) for t in ids.split(",") if t]
    except ValueError:
        return None


async def resume_text(bus: busmod.Bus, user_id: str, task_id: int) -> Resumable | None:
    """The text and tokens a task's output stream holds, assembled as a reader does (a newer attempt's chunk restarts
    the text at its offset, an older attempt's late chunk is dropped); None when there is nothing to resume from, or
    the stream cannot say which tokens made its text (a chunk without them, a gap): the run then starts over."""
    subject = busmod.output_subject(user_id, task_id)
    attempt, text, after = 0, "", 0
    tokens: list[int] = []
    while True:
        try:
            raw = await bus.js.get_msg(busmod.OUTPUT_STREAM, seq=after + 1, subject=subject, next=True)
        except NotFoundError:
            break
        if raw.seq is None or raw.data is None:
            break
        after = raw.seq
        chunk = decode(raw.data, raw.seq)
        if chunk is None or chunk.kind != TEXT or chunk.attempt < attempt:
            continue
        made = _tokens_of(raw.headers)
        if made is None:
            return None
        token_offset, ids = made
        if chunk.attempt > attempt:
            attempt, text, tokens = chunk.attempt, text[: chunk.offset], tokens[:token_offset]
        if chunk.offset != len(text) or token_offset != len(tokens):
            return None  # a gap or an overlap: which tokens made the text is no longer certain
        text += chunk.text
        tokens += ids
    return Resumable(attempt, text, tokens) if tokens else None


@dataclass(frozen=True, slots=True)
class Live:
    """A chunk as the stream republished it once stored: the chunk (its sequence set) and the sequence of the task's
    chunk before it (0: none), which shows a reader whether it missed one."""

    chunk: task_pb2.OutputChunk
    previous: int


def live(msg: Msg) -> Live | None:
    """The chunk a republished message carries; None when it is not one (no sequence header, bad payload)."""
    headers = msg.headers or {}
    try:
        sequence = int(headers.get("Nats-Sequence", ""))
        previous = int(headers.get("Nats-Last-Sequence", "0") or 0)
    except ValueError:
        return None
    chunk = decode(msg.data, sequence)
    return None if chunk is None else Live(chunk, previous)


async def read_after(
    bus: busmod.Bus, user_id: str, task_id: int, after: int, *, consistent: bool = False
) -> task_pb2.OutputChunk | None:
    """The task's first stored chunk with a sequence above `after`; None when there is none (yet).

    A direct get by default (any replica answers, no consumer); `consistent` asks the stream's leader, which has
    every acknowledged chunk (a replica may lag a moment behind): what a stream reads before it ends.
    """
    subject = busmod.output_subject(user_id, task_id)
    while True:
        try:
            raw = await bus.js.get_msg(
                busmod.OUTPUT_STREAM, seq=after + 1, subject=subject, next=True, direct=not consistent
            )
        except NotFoundError:
            return None
        if raw.seq is None or raw.data is None:
            return None
        chunk = decode(raw.data, raw.seq)
        if chunk is not None:
            return chunk
        after = raw.seq  # not a chunk (nothing but the worker writes here): skip it
