"""The state machine's Python table: terminal states, every move in the table, one typed change per move."""

from __future__ import annotations

from taskgate import states
from taskgate.states import Status
from taskgate.store import Move
from tests.support.factories import CHANGES


def test_terminal_states_have_no_exits() -> None:
    for status in states.TERMINAL:
        assert states.LEGAL[status] == frozenset()
    assert set(Status) == states.UNFINISHED | states.TERMINAL


def test_every_move_is_in_the_table() -> None:
    for move in Move:
        for src in move.sources:
            assert states.is_legal(src, move.target)


def test_every_move_has_one_typed_change() -> None:
    assert sorted(c.move.name for c in CHANGES.values()) == sorted(m.name for m in Move)
    assert all(CHANGES[m].move is m for m in Move)
