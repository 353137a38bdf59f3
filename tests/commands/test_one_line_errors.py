"""Every ``avest`` subcommand fails in one line, never a traceback: exit 2 for a usage
error, 1 for a runtime one.

The cases the issue met (a busy port, a missing trace, ``--workers 0``, ``--log-level
loud``, ``--alpha 7``, ``--rate -1``) run through the installed ``avest`` script; then
garbage goes into every flag and positional of every subcommand, the cases generated
from the parsers themselves, in process through ``avest.commands.cli.main``.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from avest.commands.cli import SERVER_COMMANDS, build_parser, main
from avest.offline.strata import merge_traces
from avest.offline.trace import write_trace
from tests.support.helpers import free_port
from tests.support.traces import make_synthetic_trace

AVEST = str(Path(sys.executable).with_name("avest"))

#: Where any string is a value (a directory to write, an id, a token): garbage there
#: is not an error, and the command may do its work (exit 0).
ANY_STRING = {
    ("evaluate", "--plot"),
    ("simulate", "--plot"),
    ("demo", "--data-dir"),
    ("serve", "--data-dir"),
    ("serve", "--replica-name"),
    ("serve", "--admin-token"),
    ("serve", "--worker-token"),
}


@pytest.fixture(scope="module")
def busy_port() -> Iterator[int]:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        yield int(taken.getsockname()[1])


@pytest.fixture(scope="module")
def tiny_trace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("trace") / "tiny.npz"
    write_trace(path, make_synthetic_trace(steps=12, requests=4, k=3))
    return path


@pytest.fixture(scope="module")
def tiny_mixed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two strata in every batch (its ``stratum`` array): what ``--strata`` and
    ``fleet``'s per-stratum report read."""
    path = tmp_path_factory.mktemp("trace") / "mixed.npz"
    sources = [make_synthetic_trace(steps=12, requests=4, k=3, seed=s) for s in (0, 1)]
    write_trace(path, merge_traces(sources, labels=["greedy", "t0.5-1"]))
    return path


def one_line(err: str) -> None:
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert 1 <= len(lines) <= 2, err


# -- the cases, through the installed script ---------------------------------


@pytest.mark.slow
def test_the_known_cases_fail_in_one_line(tmp_path: Path, busy_port: int) -> None:
    closed = f"127.0.0.1:{free_port()}"
    cases = [
        (["demo", "--grpc-address", f"127.0.0.1:{busy_port}", "--exit"], 1, "in use"),
        (["demo", "nope.npz", "--exit"], 2, "nope.npz: no such file"),
        (["replay", "--workers", "0"], 2, "--workers: must be an integer >= 1, got '0'"),
        (["serve", "--log-level", "loud"], 2, "must be one of debug, info, warning, error"),
        (["audit", "--alpha", "7"], 2, "--alpha: must be a number in (0, 1), got '7'"),
        (["replay", "--rate", "-1"], 2, "--rate: must be a number >= 0, got '-1'"),
        (["pairs", "--address", closed], 1, "is a service running there?"),
        (["schedule", "pair", "--address", closed], 1, "is a service running there?"),
        (["evaluate", "/etc/hostname"], 2, "is not an avest trace"),
        (["traces", "merge", "out.npz", "nope.npz"], 2, "nope.npz: no such file"),
        (["traces", "merge", "out", "nope.npz"], 2, "give a file name ending in .npz"),
        (["evaluate", "--strata", "--method", "mle"], 2, "--method mle: not a method of"),
    ]
    env = {k: v for k, v in os.environ.items() if not k.startswith("AVEST_")}
    procs = [
        (
            subprocess.Popen(
                [AVEST, *argv],
                cwd=tmp_path,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            ),
            argv,
            code,
            text,
        )
        for argv, code, text in cases
    ]
    for proc, argv, code, text in procs:
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == code, (argv, err)
        one_line(err)
        assert text in err, (argv, err)
        assert "allow_pickle" not in err and "pip install 'avest[server]'" not in err


# -- garbage in every flag, from the parsers -------------------------------------------


def leaves(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()) -> Iterator[tuple]:
    """``(command words, parser)`` of every runnable (sub)command."""
    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    for action in subs:
        for name, sub in action.choices.items():
            yield from leaves(sub, (*path, name))
    if not subs and path:
        yield path, parser


def typed(action: argparse.Action) -> bool:
    """A value with a domain: a number, a list of numbers, or choices."""
    return action.choices is not None or action.type not in (None, str)


#: Commands whose every argument gets garbage a second time on a trace with strata
#: (``--strata``: evaluate's per-stratum report; fleet's, which a trace carrying a
#: ``stratum`` array turns on).
STRATA_VARIANT = {("evaluate",), ("fleet",)}


def garbage_cases() -> Iterator[tuple[tuple[str, ...], str | int, str, bool, str]]:
    """``(command words, flag or positional index, value, typed, variant)`` for every
    argument (variant ``strata``: again on a trace with strata, see :data:`STRATA_VARIANT`)."""
    for words, parser in leaves(build_parser()):
        for variant in ["", "strata"] if words in STRATA_VARIANT else [""]:
            positional = 0
            for action in parser._actions:
                if action.nargs == 0 or isinstance(action, argparse._HelpAction):
                    continue
                if action.option_strings:
                    where: str | int = action.option_strings[0]
                else:
                    where, positional = positional, positional + 1
                for value in ["garbage", "-7"] if typed(action) else ["garbage"]:
                    yield words, where, value, typed(action), variant


CASES = list(garbage_cases())


def base_args(
    words: tuple[str, ...], busy_port: int, trace: Path, mixed: Path, variant: str = ""
) -> list[str]:
    """Arguments that keep a case fast and local: its positionals first, a busy port
    (so an accepted value ends at the bind check), a closed one to talk to, a tiny
    trace (``mixed``, with strata, for the ``strata`` variant)."""
    closed = f"127.0.0.1:{free_port()}"
    busy = f"127.0.0.1:{busy_port}"
    if variant == "strata":
        return {
            ("evaluate",): [str(mixed), "--refit-interval", "4", "--strata"],
            ("fleet",): [str(mixed), "--workers", "1", "--restart-every", "0", "--steps", "20"],
        }[words]
    return {
        ("serve",): ["--grpc-address", busy],
        ("demo",): [str(trace), "--grpc-address", busy, "--exit"],
        ("health",): ["--http-address", closed, "--timeout", "2"],
        ("replay",): [str(trace), "--address", closed, "--connect-timeout", "0.2"],
        ("pairs",): ["--address", closed],
        ("schedule",): ["pair", "--address", closed],
        ("record",): ["pair", "out.npz", "--http", f"http://{closed}"],
        ("store", "copy"): ["--from", "missing-store", "--to", "target"],
        ("traces", "merge"): ["out.npz", str(trace), str(mixed)],
        ("evaluate",): [str(trace), "--refit-interval", "4"],
        ("fleet",): [str(trace), "--workers", "1", "--restart-every", "0", "--steps", "20"],
        ("simulate",): [str(trace), "--concurrency", "2", "--min-steps", "0"],
        ("audit",): ["--trials", "20"],
        ("completion",): ["bash"],
    }[words]


def test_the_cases_cover_every_command() -> None:
    covered = {words for words, *_ in CASES}
    assert covered == {words for words, _ in leaves(build_parser())}
    assert len(CASES) > 100
    merge = {where for words, where, *_ in CASES if words == ("traces", "merge")}
    assert {0, 1, "--label", "--k"} <= merge
    assert {words for words, *_, variant in CASES if variant == "strata"} == STRATA_VARIANT


@pytest.mark.parametrize(
    ("words", "where", "value", "has_domain", "variant"),
    CASES,
    ids=[f"{' '.join(w)} {f} {v}{' ' + x if x else ''}" for w, f, v, _, x in CASES],
)
def test_garbage_fails_in_one_line(
    words: tuple[str, ...],
    where: str | int,
    value: str,
    has_domain: bool,
    variant: str,
    busy_port: int,
    tiny_trace: Path,
    tiny_mixed: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.chdir(tmp_path)  # whatever a garbage path makes, it makes here
    for name in [n for n in os.environ if n.startswith("AVEST_")]:
        monkeypatch.delenv(name)
    argv = [*words, *base_args(words, busy_port, tiny_trace, tiny_mixed, variant)]
    if isinstance(where, int):  # a positional: garbage in its place
        argv[len(words) + where] = value
    else:
        argv += [where, value]
    code = main(argv)
    err = capsys.readouterr().err
    assert "Traceback" not in err
    if code == 0:
        assert (words[0], where) in ANY_STRING, f"{argv} accepted: {err}"
        return
    assert code in (1, 2), (argv, code, err)
    one_line(err)
    if has_domain:
        # Refused at parse time, naming the flag and what it takes.
        assert code == 2, (argv, err)
        # A flag by its name; a positional (completion's shell) by argparse's "argument".
        assert (where if isinstance(where, str) else "argument ") in err, err


def test_help_marks_the_commands_that_need_the_server_extra(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("COLUMNS", "300")  # one line per command
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    listing = [line.split() for line in out.splitlines() if line.startswith("    ")]
    marked = [words[0] for words in listing if "[server" in words[1:2]]
    assert marked == list(SERVER_COMMANDS), out
    assert "pip install -e '.[server]'" in out and "avest[server]" not in out


@pytest.mark.parametrize("flag", ["--grpc-address", "--http-address"])
def test_serve_on_a_busy_port_is_one_line_saying_what_to_do(
    flag: str, busy_port: int, tmp_path: Path
) -> None:
    """Nothing of the service's start or stop around it: the address, the listener, the
    reason and what to do, on one line (before, a busy HTTP port logged the start and
    the stop too)."""
    address = f"127.0.0.1:{busy_port}"
    other = "--http-address" if flag == "--grpc-address" else "--grpc-address"
    env = {k: v for k, v in os.environ.items() if not k.startswith("AVEST_")}
    argv = [AVEST, "serve", flag, address, other, "127.0.0.1:0", "--data-dir", "data"]
    proc = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1, proc.stderr
    assert proc.stderr.count("\n") == 1, proc.stderr
    assert proc.stderr.startswith(f"avest serve: cannot listen on {address} ("), proc.stderr
    assert flag in proc.stderr and "in use" in proc.stderr
    assert "stop what holds it, or give free addresses" in proc.stderr
    assert not (tmp_path / "data").exists()  # refused before anything was made
