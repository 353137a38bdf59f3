"""The ``avest`` command line: one subcommand per module in ``avest.commands``.

Each module defines ``register(subparsers)``, which adds its parser and sets
``func`` to a callable returning the exit status. Modules are imported only
when their command runs... except for their parsers, which are cheap; heavy
imports (grpc, numpy work, matplotlib) live inside each ``run``.
"""

from __future__ import annotations

import argparse
import importlib
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
}

#: Subcommand modules, in the order ``avest --help`` lists them.
COMMANDS = (
    "serve",
    "health",
    "demo",
    "replay",
    "record",
    "pairs",
    "evaluate",
    "fleet",
    "simulate",
    "audit",
)


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
        except ModuleNotFoundError as exc:
            # A client-only install lacks the server's dependencies: keep the
            # command listed and say what to install when it is run.
            if exc.name and exc.name.startswith("avest.commands"):
                continue
            missing = exc.name or "a dependency"
            stub = sub.add_parser(name, help=f"(unavailable: needs {missing})")
            stub.set_defaults(func=_unavailable(name, missing))
            continue
        module.register(sub)
    return parser


def _unavailable(name: str, missing: str):  # type: ignore[no-untyped-def]
    def run(args: argparse.Namespace) -> int:
        print(
            f"avest {name} needs {missing}; install the server extra: pip install 'avest[server]'",
            file=sys.stderr,
        )
        return 2

    return run


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except ModuleNotFoundError as exc:
        # A client-only install (``pip install avest``) lacks the service's stack.
        if exc.name and exc.name.split(".")[0] in SERVER_DEPENDENCIES:
            print(
                f"avest {args.command}: needs {exc.name}, from the server extra: "
                "pip install 'avest[server]'",
                file=sys.stderr,
            )
            return 2
        raise


if __name__ == "__main__":
    raise SystemExit(main())
