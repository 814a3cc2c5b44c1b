"""Task ids: one parsing rule, time-ordered and unique."""

from __future__ import annotations

from taskgate import ids


def test_task_ids_have_one_parsing_rule() -> None:
    assert ids.parse("42") == 42 and ids.parse(str(2**63 - 1)) == 2**63 - 1
    for bad in ("", "0", "-1", "+1", " 1", "1.0", "٣", str(2**63), "9" * 20, "0x10"):
        assert ids.parse(bad) is None, bad


def test_ids_are_time_ordered_and_unique() -> None:
    made = [ids.new_id() for _ in range(10_000)]
    assert made == sorted(made) and len(set(made)) == len(made)
    assert all(0 < i < 2**63 for i in made)
