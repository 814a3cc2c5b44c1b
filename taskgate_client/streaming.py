"""A running task's partial output as the SDK hands it out: chunks (`Output`), and text deltas (`TextDelta`) put
together from text chunks by `TextAssembler`, which applies the stream's rules about attempts and offsets."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from taskgate_api.v1 import task_pb2

_KINDS = {task_pb2.OUTPUT_KIND_TEXT: "text", task_pb2.OUTPUT_KIND_PREVIEW: "preview", task_pb2.OUTPUT_KIND_LOG: "log"}


@dataclass(frozen=True, slots=True)
class Output:
    """One chunk of a task's partial output: `kind` "text" (a delta starting at `offset` of its attempt's text),
    "preview" (an image at `uri`, of denoising `step`) or "log" (a worker's line in `text`); `sequence` is where a
    stream resumes after it."""

    task_id: str
    sequence: int
    attempt: int
    kind: str
    text: str = ""
    offset: int = 0
    uri: str = ""
    content_type: str = ""
    step: int = 0
    at: datetime | None = None

    @classmethod
    def from_proto(cls, msg: task_pb2.OutputChunk) -> Output:
        return cls(
            task_id=msg.task_id, sequence=msg.sequence, attempt=msg.attempt, kind=_KINDS.get(msg.kind, "unknown"),
            text=msg.text, offset=msg.offset, uri=msg.uri, content_type=msg.content_type, step=msg.step,
            at=msg.at.ToDatetime() if msg.HasField("at") else None,
        )


@dataclass(frozen=True, slots=True)
class Preview:
    """A preview image of a running video: its denoising `step` of its `attempt`, where it is stored (`uri`, read with
    `preview_bytes`), its content type, its stream `sequence`, and its bytes when they were fetched with it."""

    task_id: str
    sequence: int
    attempt: int
    step: int
    uri: str
    content_type: str
    data: bytes | None = None
    at: datetime | None = None

    @classmethod
    def of(cls, chunk: Output, data: bytes | None = None) -> Preview:
        return cls(
            chunk.task_id, chunk.sequence, chunk.attempt, chunk.step, chunk.uri, chunk.content_type, data, chunk.at
        )


class TextDelta(str):
    """A piece of a task's text, in order (a `str`: print it). `offset` is where it starts in its attempt's text;
    `restarted` is True on the first delta of a newer attempt (a retry after a lost worker) that replaces text: the
    text from `offset` on is replaced, so a consumer that shows the text drops what it has after `offset` first. A
    newer attempt that resumed where the older one stopped (its first chunk at the end of the text so far) goes on
    with `restarted` False."""

    attempt: int
    offset: int
    restarted: bool

    def __new__(cls, text: str, *, attempt: int, offset: int, restarted: bool = False) -> TextDelta:
        delta = super().__new__(cls, text)
        delta.attempt = attempt
        delta.offset = offset
        delta.restarted = restarted
        return delta


class TextAssembler:
    """Text chunks in, text deltas out: chunks of an older attempt than the newest seen are dropped (a replaced
    worker's last words), a chunk seen again adds nothing, a newer attempt restarts the text at its offset (where
    the older one's text ended when it resumed)."""

    def __init__(self) -> None:
        self.attempt = 0
        self.text = ""  # the current attempt's text so far

    def feed(self, chunk: Output) -> TextDelta | None:
        """The new text `chunk` brings; None when it brings none."""
        if chunk.kind != "text" or chunk.attempt < self.attempt:
            return None
        restarted = chunk.attempt > self.attempt and self.attempt > 0 and chunk.offset < len(self.text)
        if chunk.attempt > self.attempt:
            self.attempt = chunk.attempt
            self.text = self.text[: chunk.offset]  # what the new attempt kept (0: nothing)
            start = chunk.offset
        else:
            start = len(self.text)
            if chunk.offset + len(chunk.text) <= start:
                return None  # already had all of it
        new = chunk.text[max(0, start - chunk.offset):]
        if not new:
            return None
        # a chunk past the end (one lost before it) still adds its text: the final text is the task's result
        self.text += new
        return TextDelta(new, attempt=chunk.attempt, offset=start, restarted=restarted)
