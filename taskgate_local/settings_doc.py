"""`python -m taskgate_local.settings_doc`: docs/configuration.md's tables of settings, one per owner's group, made from
the settings classes themselves (taskgate.config.GROUPS)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from pydantic_core import PydanticUndefined

from taskgate.config import GROUPS, CommonSettings, Settings

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


def _own_fields(group: type[CommonSettings]) -> list[str]:
    """The fields `group` adds to the common ones (all of them for CommonSettings itself)."""
    inherited = set() if group is CommonSettings else set(CommonSettings.model_fields)
    return [name for name in group.model_fields if name not in inherited]


def table() -> str:
    """One section per settings group (its owner, who reads it), one row per setting: env var, default, meaning."""
    sections = []
    for group, readers in GROUPS:
        # the docstring's first paragraph, as one line
        doc = " ".join((group.__doc__ or "").strip().split("\n\n")[0].split())
        rows = [f"### {group.__name__}: {readers}", "", doc, "", "| variable | default | meaning |", "|---|---|---|"]
        for name in _own_fields(group):
            meaning = (Settings.model_fields[name].description or "").replace("|", "\\|")
            rows.append(f"| `TASKGATE_{name.upper()}` | {_default(name)} | {meaning} |")
        sections.append("\n".join(rows))
    return "\n\n".join(sections)


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
