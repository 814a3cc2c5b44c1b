"""A background response's stream: the events OpenAI's clients parse, numbered so a reader can resume.

The events follow one task: `response.created` (0), then once it runs `response.in_progress` (1),
`response.output_item.added` (2), `response.content_part.added` (3) and one `response.output_text.delta` per new
piece of text, then `response.output_text.done`, `response.content_part.done`, `response.output_item.done` and
`response.completed` (or `response.incomplete`, `response.failed`, `response.cancelled`). Every number is a function
of the task's history and its output stream alone (chunks are immutable in JetStream and their text is placed by
offset), so the stream is built again from the start on every request and the events at or before `starting_after`
are left out: a reader that lost its connection resumes with no event missing and none repeated. A task whose
output chunks were lost (a crash, the stream's age limit) still ends with its whole text: the remainder the chunks
did not bring is one last delta before the done events.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from taskgate_api.v1 import task_pb2

from . import shapes

CREATED, IN_PROGRESS, ITEM_ADDED, PART_ADDED = 0, 1, 2, 3


@dataclass
class Events:
    """Turns a task's snapshots, transitions and output chunks into numbered OpenAI stream events."""

    task: task_pb2.Task
    after: int = -1  # starting_after: events at or before it are not sent
    sequence: int = -1  # the last number given
    text: str = ""  # the text sent in deltas so far (placed by offset)
    attempt: int = 0
    started: bool = False
    ended: bool = False
    out: list[tuple[str, dict[str, Any]]] = field(default_factory=list)

    def _emit(self, kind: str, body: dict[str, Any]) -> None:
        self.sequence += 1
        if self.sequence > self.after:
            self.out.append((kind, {"type": kind, "sequence_number": self.sequence, **body}))

    def take(self) -> list[tuple[str, dict[str, Any]]]:
        """The events made since the last take, after `starting_after`."""
        taken, self.out = self.out, []
        return taken

    def begin(self) -> None:
        self._emit("response.created", {"response": self._response(status="queued")})

    def _item(self) -> dict[str, Any]:
        return {"item_id": f"{shapes.MESSAGE_PREFIX}{self.task.id}", "output_index": 0, "content_index": 0}

    def _start(self) -> None:
        if self.started:
            return
        self.started = True
        self._emit("response.in_progress", {"response": self._response(status="in_progress")})
        self._emit(
            "response.output_item.added", {"output_index": 0, "item": shapes.message_item(self.task, "", "in_progress")}
        )
        self._emit("response.content_part.added", {
            **self._item(), "part": {"type": "output_text", "text": "", "annotations": [], "logprobs": []},
        })

    def state(self, task: task_pb2.Task) -> None:
        """A snapshot or transition: the task as it is now."""
        self.task = task
        if task.status == task_pb2.TASK_STATUS_PROCESSING or (
            task.status in shapes.TERMINAL and task.HasField("started_at")
        ):
            self._start()

    def chunk(self, chunk: task_pb2.OutputChunk) -> None:
        """One output chunk: its text placed by offset (what the stream already holds is not sent again)."""
        if chunk.kind != task_pb2.OUTPUT_KIND_TEXT or not chunk.text:
            return
        self._start()
        # a newer attempt's text starts again at 0: what it repeats of the text sent is dropped like any overlap
        self.attempt = max(self.attempt, chunk.attempt)
        have = len(self.text)
        if chunk.offset + len(chunk.text) <= have:
            return
        new = chunk.text[max(have - chunk.offset, 0):]
        self.text += new
        self._emit("response.output_text.delta", {**self._item(), "delta": new, "logprobs": []})

    def finish(self, task: task_pb2.Task, full_text: str | None) -> None:
        """The task ended: the rest of its text, the done events, and the last event of its status."""
        self.task = task
        self.ended = True
        if task.status == task_pb2.TASK_STATUS_SUCCEEDED:
            self._start()
            whole = full_text if full_text is not None else task.text.text
            if whole.startswith(self.text) and len(whole) > len(self.text):
                rest = whole[len(self.text):]
                self.text = whole
                self._emit("response.output_text.delta", {**self._item(), "delta": rest, "logprobs": []})
            final = shapes.response(task, whole)
            self._emit("response.output_text.done", {**self._item(), "text": whole, "logprobs": []})
            self._emit("response.content_part.done", {
                **self._item(), "part": {"type": "output_text", "text": whole, "annotations": [], "logprobs": []},
            })
            self._emit("response.output_item.done", {"output_index": 0, "item": shapes.message_item(task, whole)})
            kind = "response.incomplete" if final["status"] == "incomplete" else "response.completed"
            self._emit(kind, {"response": final})
        elif task.status == task_pb2.TASK_STATUS_CANCELED:
            self._emit("response.cancelled", {"response": shapes.response(task)})
        else:
            self._emit("response.failed", {"response": shapes.response(task)})

    def _response(self, status: str) -> dict[str, Any]:
        body = shapes.response(self.task)
        body["status"] = status
        return body


def encode(kind: str, body: dict[str, Any], dumps: Callable[[Any], str] = json.dumps) -> tuple[str, str]:
    """An event as its SSE `event` and `data`."""
    return kind, dumps(body)
