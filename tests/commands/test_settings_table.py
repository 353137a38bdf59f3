"""docs/settings.md's table is what ``python -m avest.settings`` prints from
``Settings``: a setting added, renamed or re-described fails here until the
page is regenerated."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from avest.settings import Settings, env_name, settings_table

PAGE = Path(__file__).resolve().parents[2] / "docs" / "settings.md"
TABLE = re.compile(r"<!-- settings table:[^\n]*-->\n(.*?)<!-- end of the settings table -->", re.S)


def test_the_settings_page_holds_the_generated_table() -> None:
    m = TABLE.search(PAGE.read_text())
    assert m, f"{PAGE} has no settings table between its markers"
    assert m.group(1) == settings_table(), (
        "docs/settings.md differs from `python -m avest.settings`; regenerate it"
    )


def test_the_table_names_every_setting_once() -> None:
    table = settings_table()
    for name, field in Settings.model_fields.items():
        flag = "--" + name.replace("_", "-")
        assert table.count(f"| `{flag}` |") == 1, flag
        assert env_name(name) in table and str(field.description) in table, name


def test_python_m_avest_settings_prints_it() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "avest.settings"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    assert out == settings_table()
