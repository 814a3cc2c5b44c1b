"""`python -m taskgate_local.settings_doc`: docs/configuration.md's table of settings, made from the Settings class itself."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from pydantic_core import PydanticUndefined

from taskgate.config import Settings

START = "<!-- settings:start -->"
END = "<!-- settings:end -->"


def _default(name: str) -> str:
    field = Settings.model_fields[name]
    if field.default is not PydanticUndefined:
        value = field.default
    elif field.default_factory is not None:
        value = field.default_factory()  # type: ignore[call-arg]
    else:
        return "(required)"
    if name == "models":
        return "wan-tiny and ltx-i2v-tiny under state_dir"
    if isinstance(value, Path):
        return f"`{value}`"
    if isinstance(value, list | tuple | dict):
        return f"`{json.dumps(value)}`"
    return "unset" if value is None else f"`{value}`"


def table() -> str:
    """One row per setting: env var, default, meaning."""
    rows = ["| variable | default | meaning |", "|---|---|---|"]
    for name, field in Settings.model_fields.items():
        meaning = (field.description or "").replace("|", "\\|")
        rows.append(f"| `TASKGATE_{name.upper()}` | {_default(name)} | {meaning} |")
    return "\n".join(rows)


def render(readme: str) -> str:
    """The page with the table between the markers replaced."""
    head, rest = readme.split(START, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{START}\n{table()}\n{END}{tail}"


def main() -> None:
    path = Path(sys.argv[1] if len(sys.argv) > 1 else "docs/configuration.md")
    path.write_text(render(path.read_text()))


if __name__ == "__main__":
    main()
