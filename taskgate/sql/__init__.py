"""SQL by name: the schema migrations, the functions re-applied on every migrate, and the named query blocks.

A block takes its parameters either positionally (`$1`, `$2`: run with `query(name)`) or by name (`@task_id`: run
with `bind(name, task_id=...)`). A named block is rewritten once, at load, to `$n` in order of first use plus the
ordered list of its names, so binding costs one tuple. `@` followed by a letter cannot be PostgreSQL (its `@`
operators are followed by a space, `>` or a digit, and `<@` is left out), and string literals and comments are skipped.
"""

from __future__ import annotations

import hashlib
import itertools
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import lru_cache
from operator import itemgetter
from pathlib import Path
from typing import Any

HERE = Path(__file__).parent
_BLOCK = re.compile(r"^-- name: (\w+)\s*$", re.MULTILINE)
_LEADING_COMMENTS = re.compile(r"\A(?:[ \t]*--[^\n]*\n)+")  # a block's description lines
# a string literal, a quoted name, a comment or a dollar-quoted body (kept as they are), or a named parameter
_LEXEME = re.compile(
    r"""'(?:[^']|'')*'|"[^"]*"|--[^\n]*|/\*.*?\*/|\$([A-Za-z_]\w*|)\$.*?\$\1\$|(?<![\w@<])@(?P<param>[a-z_]\w*)""", re.S
)
_POSITIONAL = re.compile(r"\$\d")


@dataclass(frozen=True)
class Migration:
    """One numbered schema change: its version, its file and the file's text."""

    version: int
    path: Path
    text: str

    @property
    def name(self) -> str:
        """The file name without `.sql`, as recorded in schema_migration."""
        return self.path.stem

    @property
    def checksum(self) -> str:
        """sha256 of the text, hex: once applied, a migration must keep it."""
        return hashlib.sha256(self.text.encode()).hexdigest()


@dataclass(frozen=True, slots=True)
class Named:
    """A block written with named parameters: its SQL with `$n` in their place, and their names in `$n` order."""

    text: str
    params: tuple[str, ...]
    values: Callable[[dict[str, Any]], tuple[Any, ...]] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        pick = itemgetter(*self.params) if self.params else (lambda _: ())
        # one C call that picks the values in `$n` order (itemgetter of one name returns the bare value)
        object.__setattr__(self, "values", pick if len(self.params) != 1 else (lambda v: (pick(v),)))


def parse_named(name: str, body: str) -> Named:
    """`body` with each `@param` outside literals and comments replaced by `$n`, n by first use."""
    params: dict[str, int] = {}

    def number(mark: re.Match[str]) -> str:
        param = mark.group("param")
        if param is None:
            return mark.group(0)
        return f"${params.setdefault(param, len(params) + 1)}"

    text = _LEXEME.sub(number, body)
    if params and _POSITIONAL.search(_LEXEME.sub(lambda m: "" if m.group("param") is None else m.group(0), body)):
        raise ValueError(f"query {name!r} mixes named and positional parameters")
    return Named(text, tuple(params))


def queries() -> dict[str, str]:
    """Every `-- name: x` block of queries/*.sql, by name (a named block's `@param`s already numbered)."""
    return _blocks()[0]


def named_queries() -> dict[str, Named]:
    """The blocks of queries() written with named parameters, by name."""
    found = _blocks()[1]
    _named.update(found)
    return found


@lru_cache(maxsize=1)
def _blocks() -> tuple[dict[str, str], dict[str, Named]]:
    found: dict[str, str] = {}
    named_found: dict[str, Named] = {}
    for path in sorted((HERE / "queries").glob("*.sql")):
        text = path.read_text()
        marks = list(_BLOCK.finditer(text))
        for i, mark in enumerate(marks):
            end = marks[i + 1].start() if i + 1 < len(marks) else len(text)
            body = _LEADING_COMMENTS.sub("", text[mark.end() : end].strip()).strip()
            name = mark.group(1)
            if name in found:
                raise ValueError(f"query {name!r} is defined twice")
            named = parse_named(name, body)
            # sent as `/* name */ SELECT ...`: trace spans (named by the verb) and pg_stat_statements show which block
            # ran
            found[name] = f"/* {name} */ {named.text}"
            if named.params:
                named_found[name] = Named(found[name], named.params)
    return found, named_found


def query(name: str) -> str:
    """The SQL of one block (a named block's parameters numbered in the order of named_queries()[name].params)."""
    return queries()[name]


def bind(name: str, /, **values: Any) -> tuple[Any, ...]:
    """(SQL, its arguments in `$n` order) of a block with named parameters: `db.fetch(*sql.bind("q", task_id=1))`.

    Every parameter must be given and no other (tests/unit/test_sql_named.py checks the call sites statically).
    """
    named = _named.get(name) or named_queries()[name]
    if len(values) != len(named.params):
        raise TypeError(f"query {name!r} takes {', '.join(named.params)}; given {', '.join(values)}")
    return (named.text, *named.values(values))


_named: dict[str, Named] = {}  # named_queries() once loaded: bind's lookup without a call


def migrations() -> list[Migration]:
    """Each migrations/NNNN_name.sql, in version order."""
    out: list[Migration] = []
    for path in (HERE / "migrations").glob("*.sql"):
        version = int(path.name.split("_", 1)[0])
        out.append(Migration(version=version, path=path, text=path.read_text(encoding="utf-8")))
    out.sort(key=lambda m: (m.version, m.path.name))
    for before, after in itertools.pairwise(out):
        if before.version == after.version:
            raise ValueError(f"migration version {after.version} is used twice ({before.path.name}, {after.path.name})")
    return out


def functions() -> list[Path]:
    """functions/*.sql in name order: CREATE OR REPLACE statements that migrate re-applies after the migrations."""
    return sorted((HERE / "functions").glob("*.sql"))
