"""Named SQL parameters (`@name`): how a block is numbered at load, and that every call site binds exactly the
parameters its block names (read from the call sites' syntax trees, so a query and its caller cannot drift)."""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator

import pytest

from taskgate import sql
from taskgate.store import tasks
from taskgate.store.submissions import COLUMNS
from tests.support.harness import ROOT

SOURCES = ("taskgate", "services", "bench", "taskgate_local")
# a spread's names by what it spreads: `**by_column(new)` one per submission column, `**guard` a move's guard
# (tasks.Guard), `**metered.seconds()` an attempt's measured seconds (tasks.Seconds)
SPREADS = {
    "by_column": tuple(COLUMNS),
    "guard": tuple(tasks.Guard.__annotations__),
    "seconds": tuple(tasks.Seconds.__annotations__),
}
MOST_POSITIONAL = 4  # a block with more parameters than this names them


def test_names_are_numbered_by_first_use_and_casts_literals_and_comments_are_left_alone() -> None:
    named = sql.parse_named(
        "q",
        "SELECT @b::int, '@x', \"@y\", $$ @z $$, a @> b, a <@ b, @ -1 -- @c\n/* @d */ FROM t WHERE a = @a AND b = @b",
    )
    assert named.params == ("b", "a")
    assert named.text == (
        "SELECT $1::int, '@x', \"@y\", $$ @z $$, a @> b, a <@ b, @ -1 -- @c\n/* @d */ FROM t WHERE a = $2 AND b = $1"
    )


def test_a_block_cannot_mix_named_and_positional_parameters() -> None:
    with pytest.raises(ValueError, match="mixes"):
        sql.parse_named("q", "SELECT @a, $1")
    assert sql.parse_named("q", "SELECT $1, '@a'").params == ()


def test_bind_refuses_a_missing_or_an_extra_parameter() -> None:
    name, named = next(iter(sql.named_queries().items()))
    values = dict.fromkeys(named.params, 0)
    assert sql.bind(name, **values) == (named.text, *[0] * len(named.params))
    with pytest.raises(KeyError):
        sql.bind(name, **{**{k: 0 for k in named.params[1:]}, "other": 0})
    with pytest.raises(TypeError):
        sql.bind(name, **values, other=0)


def _binds() -> Iterator[tuple[str, str, set[str]]]:
    """(where, block, the names bound) of each `sql.bind("block", ...)` call in the production code."""
    for top in SOURCES:
        for path in sorted((ROOT / top).rglob("*.py")):
            tree = ast.parse(path.read_text(), str(path))
            for node in ast.walk(tree):
                if not (
                    isinstance(node, ast.Call)
                    and isinstance(node.func, ast.Attribute)
                    and node.func.attr == "bind"
                    and isinstance(node.func.value, ast.Name)
                    and node.func.value.id == "sql"
                ):
                    continue
                where = f"{path.relative_to(ROOT)}:{node.lineno}"
                first = node.args[0] if node.args else None
                # the block named literally, or one of two (`"a" if x else "b"`) that take the same parameters
                choices = [first.body, first.orelse] if isinstance(first, ast.IfExp) else [first]
                assert all(isinstance(c, ast.Constant) for c in choices), f"{where}: name the block literally"
                bound: set[str] = set()
                for keyword in node.keywords:
                    if keyword.arg is not None:
                        bound.add(keyword.arg)
                        continue
                    spread = keyword.value.func if isinstance(keyword.value, ast.Call) else keyword.value
                    what = spread.attr if isinstance(spread, ast.Attribute) else getattr(spread, "id", None)
                    assert what in SPREADS, f"{where}: **{ast.unparse(keyword.value)} names no known parameters"
                    bound |= set(SPREADS[what])
                for choice in choices:
                    assert isinstance(choice, ast.Constant)
                    yield where, str(choice.value), bound


def test_every_call_site_binds_exactly_the_parameters_its_block_names() -> None:
    named = sql.named_queries()
    called = set()
    for where, block, bound in _binds():
        assert block in named, f"{where}: {block} has no named parameters (run it with sql.query)"
        assert bound == set(named[block].params), (
            f"{where}: {block} missing {set(named[block].params) - bound}, extra {bound - set(named[block].params)}"
        )
        called.add(block)
    assert called == set(named), f"named blocks run some other way: {set(named) - called}"


def test_a_named_block_is_run_only_through_bind() -> None:
    for top in SOURCES:
        for path in sorted((ROOT / top).rglob("*.py")):
            text = path.read_text()
            for block in sql.named_queries():
                assert f'sql.query("{block}")' not in text, f"{path}: run {block} with sql.bind"


def test_no_block_takes_more_than_a_few_positional_parameters() -> None:
    many = {}
    for name, text in sql.queries().items():
        if name not in sql.named_queries():
            count = len(set(re.findall(r"\$(\d+)", text)))
            if count > MOST_POSITIONAL:
                many[name] = count
    assert many == {}, f"name the parameters of {many}"


def test_each_move_binds_its_own_block() -> None:
    guard = tasks.Guard(
        task_id=1, sources=["PROCESSING"], expected_version=None, expected_attempt=2, actor="a", reason="r"
    )
    error = tasks.TaskError("E", "m")
    result = tasks.ResultRef("u", "video/mp4", 1, "s")
    changes: list[tasks.Change] = [
        tasks.Queue(), tasks.Republish(), tasks.Progress(5, 30.0), tasks.Succeed(result), tasks.Fail(error),
        tasks.Retry(error, 1.0), tasks.Release(), tasks.Cancel(tasks.CancelMode.SOFT), tasks.TimeOut(error),
    ]
    assert {type(c).move for c in changes} == set(tasks.Move)
    for change in changes:
        text, *values = change.bind(guard)
        assert text == sql.query(change.move.query)
        named = sql.named_queries()[change.move.query].params
        assert dict(zip(named, values, strict=True))["task_id"] == 1
