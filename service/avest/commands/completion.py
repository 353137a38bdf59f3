"""``avest completion bash|zsh``: a shell completion script, generated from the parsers.

The script completes the subcommands (``store copy`` included), each one's
flags, the values of a flag with ``choices`` (``--update-rule``, ``--log-level``)
and file names elsewhere. It is made from ``avest.commands.cli.build_parser``
when it is asked for, so it names exactly the flags of the install it runs on
(a client-only one too: no dependency beyond the standard library).

bash: ``eval "$(avest completion bash)"`` in ``~/.bashrc``, or save the output
as ``~/.local/share/bash-completion/completions/avest``. zsh: save the output
as ``_avest`` in a directory on ``$fpath`` (before ``compinit``), or
``eval "$(avest completion zsh)"`` after ``compinit``.
"""

from __future__ import annotations

import argparse
import shlex
from collections.abc import Iterator
from dataclasses import dataclass

SHELLS = ("bash", "zsh")


def register(p: argparse.ArgumentParser) -> None:
    p.add_argument("shell", choices=SHELLS, help="the shell to complete in")
    p.set_defaults(func=run)


@dataclass(frozen=True)
class Command:
    """One (sub)command: the words that lead to it and what it takes."""

    path: tuple[str, ...]  # () for avest itself, ("store", "copy") for ``avest store copy``
    words: list[str]  # subcommands and positional choices: what a bare word completes to
    flags: list[str]
    choices: dict[str, list[str]]  # a flag's values
    valued: list[str]  # flags that take a value without choices (a file name, say)


def commands(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()) -> Iterator[Command]:
    """Every command of ``parser``, depth first (``avest`` itself first)."""
    words: list[str] = []
    flags: list[str] = []
    choices: dict[str, list[str]] = {}
    valued: list[str] = []
    subs: dict[str, argparse.ArgumentParser] = {}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            subs.update(action.choices)
            words += list(action.choices)
        elif not action.option_strings:
            words += [str(c) for c in action.choices or ()]
        else:
            flags += action.option_strings
            if action.nargs == 0:
                continue
            for flag in action.option_strings:
                if action.choices is not None:
                    choices[flag] = [str(c) for c in action.choices]
                else:
                    valued.append(flag)
    yield Command(path, words, flags, choices, valued)
    for name, sub in subs.items():
        yield from commands(sub, (*path, name))


def _key(path: tuple[str, ...]) -> str:
    """A command's key in the script: its words, each after a space."""
    return "".join(f" {w}" for w in path)


def _cases(cmds: list[Command], indent: str, arm: str) -> Iterator[str]:
    """The case arms both shells share: the command path, then what it offers."""
    paths = "|".join(shlex.quote(_key(c.path)) for c in cmds if c.path)
    yield f"{indent}for ((i = {arm}; i < cword; i++)); do"
    yield f'{indent}    case "$cmdpath ${{words[i]}}" in'
    yield f'{indent}        ({paths}) cmdpath="$cmdpath ${{words[i]}}" ;;'
    yield f"{indent}    esac"
    yield f"{indent}done"
    yield f'{indent}case "$cmdpath" in'
    for c in cmds:
        yield (
            f"{indent}    ({shlex.quote(_key(c.path))}) "
            f"subs={shlex.quote(' '.join(c.words))}; flags={shlex.quote(' '.join(c.flags))} ;;"
        )
    yield f"{indent}esac"
    yield f'{indent}case "$cmdpath:$prev" in'
    for c in cmds:
        for flag, values in c.choices.items():
            yield (
                f"{indent}    ({shlex.quote(f'{_key(c.path)}:{flag}')}) "
                f"subs={shlex.quote(' '.join(values))}; flags='' ;;"
            )
        if c.valued:
            keys = "|".join(shlex.quote(f"{_key(c.path)}:{f}") for f in c.valued)
            yield f"{indent}    ({keys}) subs=''; flags='' ;;"
    yield f"{indent}esac"


#: Per shell: the comment at the top, the function's locals, the index of the word
#: after ``avest``, what it offers, and how the function is hooked up.
_SHELLS = {
    "bash": (
        [
            '# eval "$(avest completion bash)" in ~/.bashrc, or save it as',
            "# ~/.local/share/bash-completion/completions/avest",
        ],
        [
            'local cur="${COMP_WORDS[COMP_CWORD]}" prev="" cmdpath="" subs="" flags="" i',
            'local cword="$COMP_CWORD"',
            'local -a words=("${COMP_WORDS[@]}")',
            '(( cword > 0 )) && prev="${words[cword-1]}"',
        ],
        "1",
        [
            'if [[ "$cur" == -* ]]; then',
            '    COMPREPLY=($(compgen -W "$flags" -- "$cur"))',
            "else",
            '    COMPREPLY=($(compgen -W "$subs" -- "$cur"))',
            "fi",
        ],
        ["complete -o default -F _avest avest"],
    ),
    "zsh": (
        [
            "# Save it as _avest in a directory on $fpath (before compinit), or",
            '# eval "$(avest completion zsh)" after compinit.',
        ],
        [
            'local cur="${words[CURRENT]}" prev="${words[CURRENT-1]}" cmdpath="" subs="" flags=""',
            "local -i i cword=CURRENT",
        ],
        "2",
        [
            'if [[ "$cur" == -* ]]; then compadd -- ${=flags}',
            'elif [[ -n "$subs" ]]; then compadd -- ${=subs}',
            "else _files",
            "fi",
        ],
        [
            'if [[ "${zsh_eval_context[-1]}" == loadautofunc ]]; then _avest "$@"',
            "else compdef _avest avest",
            "fi",
        ],
    ),
}


def completion_script(parser: argparse.ArgumentParser, shell: str) -> str:
    """The script completing ``parser``'s commands in ``shell`` (``bash`` or ``zsh``)."""
    about, setup, first, offer, hook = _SHELLS[shell]
    lines = [
        *(["#compdef avest"] if shell == "zsh" else []),
        f"# avest completion for {shell} (avest completion {shell}): subcommands, flags, "
        "flag values.",
        *about,
        "_avest() {",
        *(f"    {line}" for line in setup),
        *_cases(list(commands(parser)), "    ", first),
        *(f"    {line}" for line in offer),
        "}",
        *hook,
    ]
    return "\n".join(lines) + "\n"


def script(shell: str) -> str:
    """The completion script for ``shell`` (``bash`` or ``zsh``)."""
    from avest.commands.cli import build_parser

    return completion_script(build_parser(), shell)


def run(args: argparse.Namespace) -> int:
    print(script(args.shell), end="")
    return 0
