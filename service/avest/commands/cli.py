"""The ``avest`` command line: one subcommand per module in ``avest.commands``.

Each module defines ``register(subparsers)``, which adds its parser and sets
``func`` to a callable returning the exit status. Modules are imported only
when their command runs... except for their parsers, which are cheap; heavy
imports (grpc, numpy work, matplotlib) live inside each ``run``.

A client-only install (``pip install avest``: numpy, grpcio, protobuf) runs
the commands that only talk to a service (``pairs``, ``replay``, ``health``,
``record``); the others exit 2 naming the server extra to install.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import signal
import sys
from collections.abc import Sequence

from avest import __version__

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

#: Subcommand modules, in the order ``avest --help`` lists them.
COMMANDS = (
    "serve",
    "health",
    "demo",
    "replay",
    "record",
    "pairs",
    "store",
    "evaluate",
    "fleet",
    "simulate",
    "audit",
)


#: What a client-only install says when a command needs the server's stack.
SERVER_EXTRA = "pip install 'avest[server]'"


def _needs_server(exc: ModuleNotFoundError) -> bool:
    return bool(exc.name) and exc.name.split(".")[0] in SERVER_DEPENDENCIES


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="avest",
        description="Acceptance-estimator sidecar for speculative decoding in vLLM.",
    )
    parser.add_argument("--version", action="version", version=f"avest {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMANDS:
        try:
            module = importlib.import_module(f"avest.commands.{name}")
            module.register(sub)
        except ModuleNotFoundError as exc:
            # A client-only install (``pip install avest``) lacks the server's
            # dependencies: keep the command listed and say what to install when
            # it is run (with whatever arguments).
            if not _needs_server(exc):
                raise
            stub = sub.add_parser(
                name, add_help=False, help=f"(needs the server extra: {SERVER_EXTRA})"
            )
            stub.set_defaults(func=_unavailable(name, exc.name or "a dependency"))
    return parser


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
    args, extra = parser.parse_known_args(argv)
    func = getattr(args, "func", None)
    if not func:
        parser.print_help()
        return 2
    if extra and not getattr(func, "unavailable", False):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
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
        raise


if __name__ == "__main__":
    raise SystemExit(main())
