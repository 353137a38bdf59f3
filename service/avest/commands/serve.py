"""``avest serve``: the sidecar on embedded defaults (SQLite in --data-dir).

Run the avest service. Every setting is also read from the environment variable shown in
brackets; a flag wins over the environment.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys

#: What ``--log-level`` takes (any case).
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")


def register(p: argparse.ArgumentParser) -> None:
    from avest import settings

    settings.add_arguments(p)
    p.set_defaults(func=run)


#: What to do about a busy address (``avest serve`` and ``avest demo`` say it).
FREE_ADDRESSES = (
    "stop what holds it, or give free addresses (--grpc-address, --http-address; port 0 picks one)"
)


def busy(grpc_address: str, http_address: str | None = None) -> str | None:
    """Why the gRPC (or admin HTTP) address cannot be bound, or ``None``: asked before
    the service starts, so that a busy port is one line (grpcio logs its own error, and
    the service its start and stop, otherwise)."""
    import socket

    listeners = [(grpc_address, "gRPC, --grpc-address")]
    if http_address is not None:
        listeners.append((http_address, "admin HTTP, --http-address"))
    for address, what in listeners:
        host, _, port = address.rpartition(":")
        try:
            infos = socket.getaddrinfo(host.strip("[]") or None, int(port), type=socket.SOCK_STREAM)
        except (OSError, ValueError):
            continue  # the service says what is wrong with it
        family, kind, proto, _, sockaddr = infos[0]
        with socket.socket(family, kind, proto) as probe:
            # As gRPC and the HTTP server bind: a port whose last connections linger
            # in TIME_WAIT is free.
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind(sockaddr)
            except OSError as exc:
                return f"cannot listen on {address} ({what}): {exc.strerror or exc}"
    return None


def run(args: argparse.Namespace) -> int:
    from avest import settings
    from avest.policy.throttle import install_storm_filter
    from avest.server import BindError, serve

    try:
        s = settings.from_sources(args)
    except ValueError as exc:
        print(f"avest serve: {exc}", file=sys.stderr)
        return 2
    if s.log_level.upper() not in LOG_LEVELS:
        print(
            f"avest serve: --log-level (AVEST_LOG_LEVEL) must be one of "
            f"{', '.join(n.lower() for n in LOG_LEVELS)}, got {s.log_level!r}",
            file=sys.stderr,
        )
        return 2
    logging.basicConfig(
        level=s.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    why = busy(s.grpc_address, s.http_address)
    if why:
        print(f"avest serve: {why}; {FREE_ADDRESSES}", file=sys.stderr)
        return 1
    install_storm_filter()
    from avest.state.guard import StoreEmptied
    from avest.state.store import StoreTooNew, StoreUnreadable

    try:
        asyncio.run(serve(s, exit_when_stopped=True))
    except (StoreTooNew, StoreEmptied, StoreUnreadable, PermissionError) as exc:
        print(f"avest serve: {exc}", file=sys.stderr)
        return 2
    except BindError as exc:  # taken between the check and the start
        print(f"avest serve: {exc}; {FREE_ADDRESSES}", file=sys.stderr)
        return 1
    return 0
