"""docs/configuration.md's settings table is the Settings class, every setting has a description, and the README is a
short guide that starts with the two commands and links the docs."""

from __future__ import annotations

import re

from taskgate.config import ModelSpec, Settings
from taskgate_local.settings_doc import render
from tests.support.harness import ROOT

README = ROOT / "README.md"
CONFIGURATION = ROOT / "docs" / "configuration.md"


def test_the_settings_table_is_current() -> None:
    text = CONFIGURATION.read_text()
    assert render(text) == text, "run `python -m taskgate_local.settings_doc` to refresh docs/configuration.md"


def test_every_setting_says_what_it_is_for() -> None:
    for cls in (Settings, ModelSpec):
        missing = [name for name, field in cls.model_fields.items() if not field.description]
        assert missing == [], f"{cls.__name__} fields without a description: {missing}"


def test_readme_starts_with_the_two_commands() -> None:
    text = README.read_text()
    assert text.index("make run") < text.index("## Documentation")
    assert "make test" in text.split("## Five-minute tour")[0]


def test_the_readme_is_short_and_every_page_it_links_exists() -> None:
    text = README.read_text()
    assert len(text.splitlines()) <= 250, "the README is a short guide: a subject of its own goes in docs/"
    linked = re.findall(r"\]\(([^)#\s]+\.md)\)", text)
    assert "docs/configuration.md" in linked and "docs/sdk.md" in linked
    missing = [page for page in linked if not (ROOT / page).is_file()]
    assert missing == [], f"the README links pages that do not exist: {missing}"
