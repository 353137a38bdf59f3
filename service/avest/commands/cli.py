"""The ``avest`` command line: one subcommand per module in ``avest.commands``.

Each module defines ``register(parser)``, which adds its command's arguments to
the parser made here (its docstring is the command's description) and sets
``func`` to a callable returning the exit status. Modules are imported only when
their command runs... except for their parsers, which are cheap; heavy imports
(grpc, numpy work, matplotlib) live inside each ``run``.

A client-only install (``pip install .``: numpy, grpcio, protobuf) runs the
commands that only talk to a service (``pairs``, ``replay``, ``health``,
``record``) and the offline ones on numpy alone; the others exit 2 naming the
server extra to install, and ``avest --help`` marks them.

Every failure is one line on stderr, never a traceback: exit status 2 for a
usage error (a flag's value out of its domain, a file that is not a trace), 1
for a runtime one (no service, a busy port). ``AVEST_DEBUG=1`` shows the
traceback of an unexpected error.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.util
import os
import signal
import sys
from collections.abc import Sequence
from typing import NoReturn

from avest import __version__
from avest.commands.options import TokenFileError

#: Packages of the ``server`` extra, absent from a client-only install.
SERVER_DEPENDENCIES = {
    "fastapi",
    "uvicorn",
    "prometheus_client",
    "grpc_health",
    "grpc_reflection",
    "tqdm",
    "matplotlib",
    "starlette",
    "pydantic",
    "pydantic_core",
    "pydantic_settings",
    "psycopg",
}

#: Subcommand modules, in the order ``avest --help`` lists them, with the line it
#: gives each. A module's docstring is its command's ``--help`` description.
COMMANDS = {
    "serve": "run the estimator service (gRPC + admin HTTP)",
    "health": "probe a running service's /healthz (exit 0 when healthy), with or without TLS",
    "demo": "start a service, replay a bundled trace as several workers, watch it converge",
    "replay": "stream a trace into a running service as simulated workers",
    "record": "record a pair's incoming raw steps (or a sampled fraction) to an avest-trace/1 file",
    "pairs": "list the pairs of a running service",
    "schedule": "print a pair's draft length by batch size, ready for vLLM's --speculative-config",
    "store": "move pairs between stores (SQLite, PostgreSQL)",
    "traces": "build traces from recorded ones (merge)",
    "evaluate": "replay a trace predict-then-learn and measure every method",
    "fleet": "in-worker vLLM estimators against avest's pooled one, for W workers",
    "simulate": "simulate the goodput of adaptive verification on a trace",
    "audit": "check budget rules for losslessness by Monte Carlo",
    "completion": "print a shell completion script (bash or zsh)",
}


#: Commands that need the server extra whatever their arguments (``avest --help``
#: marks them in a client-only install).
SERVER_COMMANDS = ("serve", "demo", "evaluate", "simulate")

#: What a client-only install says when a command needs the server's stack (avest
#: is not on PyPI: it installs from a checkout).
SERVER_EXTRA = "run `pip install -e '.[server]'` in the avest checkout"

#: Set to show the traceback of an unexpected error.
DEBUG_ENV = "AVEST_DEBUG"


class Parser(argparse.ArgumentParser):
    """A parser whose usage error is one line: what was wrong, and where to look
    (argparse's own prints the whole usage, 20 lines for ``serve``)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: {message} (see `{self.prog} --help`)\n")


def _server_extra_missing() -> str | None:
    """The first server dependency not installed, or ``None`` with the extra in place."""
    for name in ("fastapi", "uvicorn", "pydantic_settings", "tqdm"):
        if importlib.util.find_spec(name) is None:
            return name
    return None


def _needs_server(exc: ModuleNotFoundError) -> bool:
    return bool(exc.name) and exc.name.split(".")[0] in SERVER_DEPENDENCIES


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="avest",
        description="Acceptance-estimator sidecar for speculative decoding in vLLM.",
        epilog=f"[server extra]: the command needs the server extra ({SERVER_EXTRA}); "
        "the others run on a client-only install.",
    )
    parser.add_argument("--version", action="version", version=f"avest {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    missing = _server_extra_missing()
    for name in COMMANDS:
        if missing and name in SERVER_COMMANDS:
            _add_unavailable(sub, name, missing)
            continue
        try:
            module = importlib.import_module(f"avest.commands.{name}")
            module.register(_add_command(sub, name, module.__doc__ or ""))
        except ModuleNotFoundError as exc:
            # A client-only install (``pip install avest``) lacks the server's
            # dependencies: keep the command listed and say what to install when
            # it is run (with whatever arguments).
            if not _needs_server(exc):
                raise
            _add_unavailable(sub, name, exc.name or "a dependency")
    for listed in sub._choices_actions:
        if listed.dest in SERVER_COMMANDS and "server extra" not in (listed.help or ""):
            listed.help = f"[server extra] {listed.help}"
    return parser


def _add_command(sub: argparse._SubParsersAction, name: str, doc: str) -> argparse.ArgumentParser:  # type: ignore[type-arg]
    """The command's parser: ``avest --help`` lists its line from :data:`COMMANDS`, its
    own ``--help`` shows its module's docstring (reST's double backquotes dropped)."""
    return sub.add_parser(
        name,
        help=COMMANDS[name],
        description=doc.replace("``", "").strip(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )


def _add_unavailable(sub: argparse._SubParsersAction, name: str, missing: str) -> None:  # type: ignore[type-arg]
    stub = sub.add_parser(
        name, add_help=False, help=f"[server extra] not installed: {SERVER_EXTRA}"
    )
    stub.set_defaults(func=_unavailable(name, missing))


def _unavailable(name: str, missing: str):  # type: ignore[no-untyped-def]
    def run(args: argparse.Namespace) -> int:
        print(
            f"avest {name}: needs the server extra ({missing} is not installed): {SERVER_EXTRA}",
            file=sys.stderr,
        )
        return 2

    run.unavailable = True  # type: ignore[attr-defined]
    return run


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    try:
        args, extra = parser.parse_known_args(argv)
        func = getattr(args, "func", None)
        if not func:
            parser.print_help()
            return 2
        if extra and not getattr(func, "unavailable", False):
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
    except SystemExit as exc:  # a usage error (2), or --help / --version (0)
        return exc.code if isinstance(exc.code, int) else 2
    try:
        status = int(func(args) or 0)
        sys.stdout.flush()  # a closed pipe shows here, not at interpreter exit
        return status
    except BrokenPipeError:
        # The reader went away (``avest pairs --json | head``): stop quietly, as a
        # tool killed by SIGPIPE would, and keep the exit-time flush from failing too.
        with contextlib.suppress(OSError, ValueError):
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
        return 128 + signal.SIGPIPE
    except ModuleNotFoundError as exc:
        # A client-only install (``pip install avest``) lacks the service's stack.
        if _needs_server(exc):
            print(
                f"avest {args.command}: needs the server extra ({exc.name} is not installed): "
                f"{SERVER_EXTRA}",
                file=sys.stderr,
            )
            return 2
        return _unexpected(args.command, exc)
    except TokenFileError as exc:
        print(f"avest {args.command}: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"avest {args.command}: interrupted", file=sys.stderr)
        return 128 + signal.SIGINT
    except Exception as exc:
        return _unexpected(args.command, exc)


def _unexpected(command: str, exc: BaseException) -> int:
    """An error no command foresaw: one line naming it, exit 1 (the traceback with
    ``AVEST_DEBUG=1``)."""
    if os.environ.get(DEBUG_ENV):
        raise exc
    what = str(exc).strip().splitlines()
    print(
        f"avest {command}: {type(exc).__name__}: {what[0] if what else 'no details'} "
        f"(unexpected; {DEBUG_ENV}=1 shows the traceback)",
        file=sys.stderr,
    )
    return 1


if __name__ == "__main__":
    raise SystemExit(main())
