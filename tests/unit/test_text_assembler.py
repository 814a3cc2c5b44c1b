"""The SDK's TextAssembler: how a newer attempt's text joins an older one's (restarted only when text is replaced)."""

from __future__ import annotations

from taskgate_client import Output, TextAssembler


def chunk(attempt: int, offset: int, text: str) -> Output:
    return Output(task_id="1", sequence=0, attempt=attempt, kind="text", text=text, offset=offset)


def test_a_resumed_attempt_goes_on_and_a_restarted_one_replaces() -> None:
    text = TextAssembler()
    assert text.feed(chunk(1, 0, "Hello ")) == "Hello "
    resumed = text.feed(chunk(2, 6, "there"))  # attempt 2 went on from the end of attempt 1's text
    assert resumed == "there" and not resumed.restarted and (resumed.attempt, resumed.offset) == (2, 6)
    replaced = text.feed(chunk(3, 3, "p!"))  # attempt 3 kept only "Hel"
    assert replaced == "p!" and replaced.restarted and text.text == "Help!"
    assert text.feed(chunk(2, 11, "late")) is None  # an older attempt's chunk
