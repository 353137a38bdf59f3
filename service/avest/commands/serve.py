"""``avest serve``: the sidecar on embedded defaults (SQLite in --data-dir)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys


def register(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    from avest import settings

    p = subparsers.add_parser(
        "serve",
        help="run the estimator service (gRPC + admin HTTP)",
        description="Run the avest service. Every setting is also read from the "
        "environment variable shown in brackets; a flag wins over the environment.",
    )
    settings.add_arguments(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from avest import settings
    from avest.policy.throttle import install_storm_filter
    from avest.server import BindError, serve

    try:
        s = settings.from_sources(args)
    except ValueError as exc:
        print(f"avest serve: {exc}")
        return 2
    logging.basicConfig(
        level=s.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    install_storm_filter()
    from avest.state.guard import StoreEmptied
    from avest.state.store import StoreTooNew, StoreUnreadable

    try:
        asyncio.run(serve(s, exit_when_stopped=True))
    except (StoreTooNew, StoreEmptied, StoreUnreadable, PermissionError) as exc:
        print(f"avest serve: {exc}", file=sys.stderr)
        return 2
    except BindError as exc:
        print(f"avest serve: {exc}", file=sys.stderr)
        return 1
    return 0
