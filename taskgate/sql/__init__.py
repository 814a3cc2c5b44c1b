"""SQL by name: the schema migrations and the named query blocks live beside this module."""

from __future__ import annotations

import re
from functools import lru_cache
from pathlib import Path

HERE = Path(__file__).parent
_BLOCK = re.compile(r"^-- name: (\w+)\s*$", re.MULTILINE)


@lru_cache(maxsize=1)
def queries() -> dict[str, str]:
    """Every `-- name: x` block of queries/*.sql, by name."""
    found: dict[str, str] = {}
    for path in sorted((HERE / "queries").glob("*.sql")):
        text = path.read_text()
        marks = list(_BLOCK.finditer(text))
        for i, mark in enumerate(marks):
            end = marks[i + 1].start() if i + 1 < len(marks) else len(text)
            body = text[mark.end() : end].strip()
            name = mark.group(1)
            if name in found:
                raise ValueError(f"query {name!r} is defined twice")
            found[name] = body
    return found


def query(name: str) -> str:
    """The SQL of one named block."""
    return queries()[name]


def migrations() -> list[tuple[int, str, str]]:
    """(version, name, sql) of each migration, in order."""
    out = []
    for path in sorted((HERE / "migrations").glob("*.sql")):
        version = int(path.name.split("_", 1)[0])
        out.append((version, path.stem, path.read_text()))
    return out
