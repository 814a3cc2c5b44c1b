"""SQL by name: the schema migrations, the functions re-applied on every migrate, and the named query blocks."""

from __future__ import annotations

import hashlib
import itertools
import re
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

HERE = Path(__file__).parent
_BLOCK = re.compile(r"^-- name: (\w+)\s*$", re.MULTILINE)
_LEADING_COMMENTS = re.compile(r"\A(?:[ \t]*--[^\n]*\n)+")  # a block's description lines


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


@lru_cache(maxsize=1)
def queries() -> dict[str, str]:
    """Every `-- name: x` block of queries/*.sql, by name."""
    found: dict[str, str] = {}
    for path in sorted((HERE / "queries").glob("*.sql")):
        text = path.read_text()
        marks = list(_BLOCK.finditer(text))
        for i, mark in enumerate(marks):
            end = marks[i + 1].start() if i + 1 < len(marks) else len(text)
            body = _LEADING_COMMENTS.sub("", text[mark.end() : end].strip()).strip()
            name = mark.group(1)
            if name in found:
                raise ValueError(f"query {name!r} is defined twice")
            # sent as `/* name */ SELECT ...`: trace spans (named by the verb) and pg_stat_statements show which block ran
            found[name] = f"/* {name} */ {body}"
    return found


def query(name: str) -> str:
    """The SQL of one named block."""
    return queries()[name]


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
