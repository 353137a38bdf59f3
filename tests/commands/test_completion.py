"""``avest completion bash|zsh``: scripts generated from the parsers, that complete.

bash: the script passes ``bash -n``, and sourced in a real bash its function
completes subcommands, flags and flag choices (``COMP_WORDS``/``COMP_CWORD`` set as
bash sets them). Every subcommand and flag of the parser is in both scripts (the
expectation walks the parser). zsh: ``zsh -n`` and a completion run where zsh is
installed; otherwise only the script's text is checked.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from avest.commands.cli import build_parser

AVEST = str(Path(sys.executable).with_name("avest"))


@pytest.fixture(scope="module")
def scripts() -> dict[str, str]:
    """Each shell's script, as the installed ``avest`` prints it."""
    out = {}
    for shell in ("bash", "zsh"):
        proc = subprocess.run(
            [AVEST, "completion", shell], capture_output=True, text=True, timeout=60
        )
        assert proc.returncode == 0 and not proc.stderr, proc.stderr
        out[shell] = proc.stdout
    return out


def every_word(parser: argparse.ArgumentParser) -> Iterator[str]:
    """Every subcommand name, flag and flag choice of ``parser``, recursively."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield name
                yield from every_word(sub)
            continue
        yield from action.option_strings
        if action.choices is not None:
            yield from (str(c) for c in action.choices)


def complete_in_bash(script: str, line: str) -> list[str]:
    """What bash's completion function offers for ``line`` (the cursor at its end)."""
    words = line.split(" ")
    driver = (
        f"{script}\nCOMP_WORDS=({' '.join(repr(w) for w in words)})\n"
        f"COMP_CWORD={len(words) - 1}\nCOMP_LINE={line!r}\nCOMP_POINT={len(line)}\n"
        '_avest\nprintf "%s\\n" "${COMPREPLY[@]}"\n'
    )
    proc = subprocess.run(["bash", "--norc", "-c", driver], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.split()


@pytest.mark.parametrize("shell", ["bash", "zsh"])
def test_every_subcommand_flag_and_choice_is_in_the_script(
    shell: str, scripts: dict[str, str]
) -> None:
    words = set(every_word(build_parser()))
    assert {"replay", "completion", "copy", "--workers", "--update-rule", "zsh"} <= words
    tokens = set(scripts[shell].replace("'", " ").replace("|", " ").split())
    assert not words - tokens, sorted(words - tokens)


def test_the_bash_script_parses(scripts: dict[str, str], tmp_path: Path) -> None:
    path = tmp_path / "avest.bash"
    path.write_text(scripts["bash"])
    proc = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert "complete -o default -F _avest avest" in scripts["bash"]


@pytest.mark.parametrize(
    ("line", "offered"),
    [
        ("avest rep", ["replay"]),
        ("avest replay --wo", ["--workers"]),
        ("avest s", ["serve", "schedule", "store", "simulate"]),
        ("avest store c", ["copy"]),
        ("avest store copy --f", ["--from", "--force"]),
        ("avest tr", ["traces"]),
        ("avest traces ", ["merge"]),
        ("avest traces merge --l", ["--label", "--longest"]),
        ("avest evaluate --st", ["--strata"]),
        ("avest completion ", ["bash", "zsh"]),
        ("avest simulate --update-rule tr", ["tracking"]),
        ("avest fleet --rule ", None),  # the rule names, from the parser
        ("avest evaluate --plot ", []),  # a directory: bash's own file names
        ("avest --v", ["--version"]),
    ],
)
def test_bash_completes(line: str, offered: list[str] | None, scripts: dict[str, str]) -> None:
    if offered is None:
        sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
        rule = next(a for a in sub.choices["fleet"]._actions if "--rule" in a.option_strings)
        offered = [str(c) for c in rule.choices or ()]
        assert offered
    assert complete_in_bash(scripts["bash"], line) == offered


def test_the_zsh_script(scripts: dict[str, str], tmp_path: Path) -> None:
    text = scripts["zsh"]
    assert text.startswith("#compdef avest\n")
    assert "_avest() {" in text and "compdef _avest avest" in text and "_files" in text
    assert "(' replay') subs=''; flags='-h --help --address" in text
    assert "(' simulate:--update-rule') subs=" in text
    zsh = shutil.which("zsh")
    if zsh is None:
        pytest.skip(
            "zsh is not installed (scripts/check installs it as root): its script's text only"
        )
    path = tmp_path / "_avest"
    path.write_text(text)
    proc = subprocess.run([zsh, "-n", str(path)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    driver = (
        f"compadd() {{ shift; print -l -- $@; }}\n_files() {{ print FILES; }}\n"
        f"compdef() {{ :; }}\nsource {path}\n"
        "words=(avest replay --wo); CURRENT=3; _avest\n"
    )
    proc = subprocess.run([zsh, "-f", "-c", driver], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert "--workers" in proc.stdout.split()
