"""Service settings: flags, ``AVEST_*`` environment variables, defaults.

Every setting has a flag and an environment variable (the flag's name upper
cased with ``AVEST_`` in front); a flag given on the command line wins over
the environment, which wins over the default.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, fields
from pathlib import Path


@dataclass(frozen=True)
class Settings:
    grpc_address: str = "127.0.0.1:50051"
    http_address: str = "127.0.0.1:8000"
    data_dir: str = "./avest-data"
    #: Update rule for pairs that do not ask for one (see README: measured).
    default_rule: str = "recursive"
    refit_interval: int = 100
    #: Recursive rule: forgetting per round and prior precision.
    forgetting: float = 0.95
    prior: float = 1.0
    #: Group commit: acknowledged batches are made durable at least this often.
    flush_interval_ms: int = 100
    max_pairs: int = 1024
    max_message_bytes: int = 4 * 1024 * 1024
    max_rows: int = 8192
    #: Token for POST /v1/pairs/{id}/reset; empty means no token needed.
    admin_token: str = ""
    #: Seconds SIGTERM waits for streams to close before the final snapshot.
    grace_s: float = 5.0
    log_level: str = "info"

    @property
    def database(self) -> Path:
        return Path(self.data_dir) / "avest.sqlite3"


HELP = {
    "grpc_address": "gRPC listen address HOST:PORT (port 0 picks a free port)",
    "http_address": "admin HTTP listen address HOST:PORT (port 0 picks a free port)",
    "data_dir": "directory holding the SQLite database",
    "default_rule": "update rule for pairs that do not name one: vllm or recursive",
    "refit_interval": "refit every N observed steps (pooled across workers)",
    "forgetting": "recursive rule: information kept per round, in (0, 1]",
    "prior": "recursive rule: precision of the pull toward the starting coefficients",
    "flush_interval_ms": "make applied batches durable (and acknowledge them) this often",
    "max_pairs": "refuse to register more pairs than this",
    "max_message_bytes": "largest gRPC message accepted",
    "max_rows": "largest number of requests (rows) in one message",
    "admin_token": "bearer token required by POST /v1/pairs/{id}/reset (empty: none)",
    "grace_s": "seconds SIGTERM waits for streams to drain",
    "log_level": "debug, info, warning or error",
}


def env_name(field_name: str) -> str:
    return "AVEST_" + field_name.upper()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """One ``--flag`` per setting; defaults come from the environment."""
    for f in fields(Settings):
        flag = "--" + f.name.replace("_", "-")
        parser.add_argument(
            flag,
            dest=f.name,
            type=type(f.default),
            default=None,
            metavar=f.name.upper(),
            help=f"{HELP[f.name]} [env {env_name(f.name)}, default {f.default!r}]",
        )


def from_sources(
    args: argparse.Namespace | None = None, env: dict[str, str] | None = None
) -> Settings:
    """Flags over ``AVEST_*`` environment over defaults; validates values."""
    environ = os.environ if env is None else env
    values: dict[str, object] = {}
    for f in fields(Settings):
        flag = getattr(args, f.name, None) if args is not None else None
        if flag is not None:
            values[f.name] = flag
        elif env_name(f.name) in environ:
            raw = environ[env_name(f.name)]
            try:
                values[f.name] = type(f.default)(raw)
            except ValueError as exc:
                raise ValueError(f"{env_name(f.name)}={raw!r}: {exc}") from None
    settings = Settings(**values)  # type: ignore[arg-type]
    validate(settings)
    return settings


def validate(s: Settings) -> None:
    if s.default_rule not in ("vllm", "recursive"):
        raise ValueError(f"default_rule must be vllm or recursive, got {s.default_rule!r}")
    if s.refit_interval < 1:
        raise ValueError("refit_interval must be >= 1")
    if not 0.0 < s.forgetting <= 1.0:
        raise ValueError("forgetting must be in (0, 1]")
    for name in ("grpc_address", "http_address"):
        split_address(getattr(s, name))


def split_address(address: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"address must be HOST:PORT, got {address!r}")
    return host.strip("[]") or "0.0.0.0", int(port)
