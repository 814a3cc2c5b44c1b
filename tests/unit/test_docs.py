"""The README's configuration table is the Settings class, and every setting has a description."""

from __future__ import annotations

from taskgate.config import ModelSpec, Settings
from taskgate_local.settings_doc import render
from tests.support.harness import ROOT

README = ROOT / "README.md"


def test_readme_settings_table_is_current() -> None:
    text = README.read_text()
    assert render(text) == text, "run `python -m taskgate_local.settings_doc` to refresh README.md"


def test_every_setting_says_what_it_is_for() -> None:
    for cls in (Settings, ModelSpec):
        missing = [name for name, field in cls.model_fields.items() if not field.description]
        assert missing == [], f"{cls.__name__} fields without a description: {missing}"


def test_readme_starts_with_the_two_commands() -> None:
    text = README.read_text()
    assert text.index("make run") < text.index("## Architecture")
    assert "make test" in text.split("## Five-minute tour")[0]
