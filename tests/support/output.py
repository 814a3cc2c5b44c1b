"""A task's partial output as tests read it: every chunk of its TASK_OUTPUT subject, and one attempt's text from
them."""

from __future__ import annotations

from nats.js.errors import NotFoundError

from taskgate import bus as busmod
from taskgate import output
from taskgate.runtime import Backends
from taskgate_api.v1 import task_pb2


async def chunks(backends: Backends, user_id: str, task_id: str) -> list[task_pb2.OutputChunk]:
    """Every chunk of a task's output stream, in stream order."""
    subject = busmod.output_subject(user_id, int(task_id))
    found: list[task_pb2.OutputChunk] = []
    seq = 1
    while True:
        try:
            msg = await backends.bus.js.get_msg(busmod.OUTPUT_STREAM, seq=seq, subject=subject, next=True)
        except NotFoundError:
            return found
        decoded = output.decode(msg.data or b"", int(msg.seq or 0))
        assert decoded is not None
        found.append(decoded)
        seq = int(msg.seq or 0) + 1


def text_of(found: list[task_pb2.OutputChunk], attempt: int, start: int = 0) -> str:
    """An attempt's text from its chunks, checking that the first starts at `start` (where an attempt that resumed an
    earlier one's text began) and each one after it where the one before it ended."""
    text = ""
    for c in found:
        if c.attempt == attempt:
            assert c.kind == task_pb2.OUTPUT_KIND_TEXT and c.offset == start + len(text), (c.offset, start, len(text))
            text += c.text
    return text
