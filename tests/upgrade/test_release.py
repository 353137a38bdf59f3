"""The release this checkout is: one version everywhere the service reports it, a
CHANGELOG entry for it, and a wire contract that only grew since 0.1.0."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import tomllib

import avest
from avest.commands.cli import main

REPO = Path(__file__).resolve().parents[2]


def test_one_version_in_pyproject_the_package_and_the_cli(capsys):
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert project["version"] == avest.__version__
    try:
        main(["--version"])
    except SystemExit as exc:
        assert exc.code == 0
    assert capsys.readouterr().out.strip() == f"avest {avest.__version__}"
    done = subprocess.run(
        [sys.executable, "-m", "avest.commands.cli", "--version"], capture_output=True, text=True
    )
    assert done.stdout.strip() == f"avest {avest.__version__}"


def test_the_changelog_has_this_release_and_upgrade_notes():
    text = (REPO / "CHANGELOG.md").read_text()
    release = avest.__version__.split(".dev")[0]
    assert re.search(rf"^## {re.escape(release)}\b", text, re.M)
    assert re.search(r"^## 0\.1\.0\b", text, re.M)
    for heading in ("### Upgrading with Docker Compose", "### Upgrading on Kubernetes"):
        assert heading in text
