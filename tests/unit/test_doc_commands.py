"""Every command the README and docs/ show in a shell block exists as written: a `make` target of the Makefile, a
`python -m` module, and a `taskgate` / `taskgate-keys` command line that their own parsers accept (so a renamed
subcommand or flag fails here, not in a reader's terminal)."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import re
import shlex
from collections.abc import Iterator
from pathlib import Path

import pytest

from taskgate.keys import build_parser as keys_parser
from taskgate_client.cli.parser import build_parser as cli_parser
from tests.support.harness import ROOT

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
_SHELL = ("", "sh", "bash", "console", "shell")  # a block with no language may hold commands too
_ENV = re.compile(r"^[A-Z_][A-Z0-9_]*=\S*$")


def _blocks(text: str) -> Iterator[str]:
    """The text of each fenced block in a shell language or none."""
    language: str | None = None
    lines: list[str] = []
    for line in text.splitlines():
        if line.startswith("```"):
            if language is None:
                language, lines = line[3:].strip(), []
            else:
                if language in _SHELL:
                    yield "\n".join(lines) + "\n"
                language = None
        elif language is not None:
            lines.append(line)


def _commands(page: Path) -> Iterator[tuple[str, list[str]]]:
    """(the line, its words) for each simple command of each shell block; a line with shell syntax the check cannot
    read (substitutions, variables in the command word) is split at its operators and each part checked alone."""
    for block in _blocks(page.read_text()):
        for raw in block.replace("\\\n", " ").splitlines():
            line = raw.split(" #", 1)[0].strip().removeprefix("$ ")
            if not line or line.startswith("#") or "$(" in line or "<<" in line:
                continue
            for part in re.split(r"\s*(?:\|\||&&|\||;)\s*", line):
                part = part.strip().rstrip("&").strip()
                try:
                    words = shlex.split(part)
                except ValueError:
                    continue
                while words and (_ENV.match(words[0]) or words[0] in ("export", "sudo", "time", "env")):
                    words = words[1:]
                if words:
                    yield line, words


def _all() -> list[tuple[str, str, list[str]]]:
    return [(page.relative_to(ROOT).as_posix(), line, words) for page in PAGES for line, words in _commands(page)]


def _make_targets() -> set[str]:
    text = (ROOT / "Makefile").read_text()
    return set(re.findall(r"^([a-z][\w-]*):", text, re.MULTILINE))


def _parses(parser_factory: object, args: list[str]) -> str | None:
    """None when the parser accepts the words, else what it said."""
    parser = parser_factory()  # type: ignore[operator]
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            parser.parse_args(args)
        except SystemExit as exit_:
            if exit_.code not in (0, None):
                return err.getvalue().strip().splitlines()[-1] if err.getvalue() else f"exit {exit_.code}"
    return None


def test_the_pages_show_commands() -> None:
    found = _all()
    assert any(words[0] == "make" for _, _, words in found)
    assert any(words[0].endswith("taskgate") for _, _, words in found)


@pytest.mark.parametrize(("page", "line", "words"), _all(), ids=lambda v: v if isinstance(v, str) else None)
def test_a_documented_command_exists(page: str, line: str, words: list[str]) -> None:
    command = words[0].rsplit("/", 1)[-1]
    if command == "make":
        targets = [w for w in words[1:] if not w.startswith("-") and "=" not in w]
        assert set(targets) <= _make_targets(), f"{page}: `{line}` names a make target the Makefile lacks"
    elif command in ("python", "python3") and words[1:2] == ["-m"]:
        module = words[2]
        assert importlib.util.find_spec(module) is not None, f"{page}: `{line}`: no module {module}"
    elif command == "taskgate":
        said = _parses(cli_parser, words[1:])
        assert said is None, f"{page}: `{line}`: the CLI refuses it: {said}"
    elif command == "taskgate-keys":
        said = _parses(keys_parser, words[1:])
        assert said is None, f"{page}: `{line}`: taskgate-keys refuses it: {said}"
