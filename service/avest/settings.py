"""Service settings: flags, ``AVEST_*`` environment variables, defaults.

Every setting has a flag and an environment variable (the flag's name upper
cased with ``AVEST_`` in front); a flag given on the command line wins over
the environment, which wins over the default. pydantic-settings reads the
environment and checks the values; the flags are argparse's, one per field.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pydantic import Field, ValidationError, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from avest.core.rule_factory import RULE_NAMES
from avest.grpc.limits import PAIR_PUSHES_PER_S, SKETCHED_WORKERS, StreamLimits
from avest.state.config import StateConfig
from avest.state.stores import is_postgres

ENV_PREFIX = "AVEST_"


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, frozen=True, extra="ignore")

    grpc_address: str = Field(
        "127.0.0.1:50051", description="gRPC listen address HOST:PORT (port 0 picks a free port)"
    )
    http_address: str = Field(
        "127.0.0.1:8000",
        description="admin HTTP listen address HOST:PORT (port 0 picks a free port)",
    )
    read_address: str = Field(
        "",
        description="read port HOST:PORT: GetCoefficients, Score and Budget (and gRPC "
        "health) on a gRPC server of its own threads, answered while Observe streams keep "
        "the main port busy; empty for none",
    )
    grpc_process: bool = Field(
        False,
        description="serve the gRPC port from a process of its own, which relays each call "
        "to this one: gRPC's I/O gets a core of its own, so calls and new streams are taken "
        "at once while the pairs' owners keep this process busy",
    )
    data_dir: str = Field("./avest-data", description="directory holding the SQLite database")
    store: str = Field(
        "",
        description="where pairs are stored: empty for the SQLite file in --data-dir, or a "
        "PostgreSQL URL postgresql://USER@HOST:PORT/DB. Every process on one PostgreSQL "
        "database is a replica serving the same pairs",
    )
    replica_name: str = Field(
        "",
        description="this replica's name in logs and metrics (with a PostgreSQL store), "
        "unique among the replicas; empty for the host name and the process id",
    )
    #: Update rule for pairs that do not ask for one (see docs/estimator.md: measured).
    default_rule: str = Field(
        "tracking",
        description="update rule for pairs that do not name one: tracking, vllm or recursive",
    )
    refit_interval: int = Field(
        100, ge=1, description="refit every N observed steps (pooled across workers)"
    )
    forgetting: float = Field(
        0.95, gt=0.0, le=1.0, description="recursive rule: information kept per round, in (0, 1]"
    )
    prior: float = Field(
        1.0,
        gt=0,
        description="recursive rule: precision of the pull toward the starting coefficients",
    )
    flush_interval_ms: int = Field(
        100, ge=0, description="make applied batches durable (and acknowledge them) this often"
    )
    max_pairs: int = Field(1024, ge=1, description="refuse to register more pairs than this")
    max_message_bytes: int = Field(
        4 * 1024 * 1024, ge=1, description="largest gRPC message accepted"
    )
    max_rows: int = Field(
        8192, ge=1, description="largest number of requests (rows) in one message"
    )
    admin_token: str = Field(
        "",
        description="bearer token of admin actions: reset, delete, cost curves "
        "(empty: admin actions refused)",
    )
    worker_token: str = Field(
        "",
        description="bearer token of workers: register, observe, read (empty: open, "
        "loopback only unless --insecure)",
    )
    tls_cert: str = Field("", description="PEM certificate chain: serve gRPC and HTTP over TLS")
    tls_key: str = Field("", description="PEM private key of --tls-cert")
    tls_client_ca: str = Field(
        "", description="PEM CA bundle: require client certificates signed by it (mutual TLS)"
    )
    insecure: bool = Field(
        False, description="allow listening beyond loopback without a worker token"
    )
    max_connections: int = Field(
        4096,
        ge=1,
        description="open connections per listener (gRPC and HTTP) before refusing; "
        "at most half the open-file limit",
    )
    max_streams: int = Field(
        4096, ge=1, description="concurrent gRPC calls before RESOURCE_EXHAUSTED"
    )
    idle_timeout_s: float = Field(
        300.0, gt=0, description="close a connection with no call for this long"
    )
    handshake_timeout_s: float = Field(
        5.0, gt=0, description="close a connection that has not finished its handshake"
    )
    rpc_rate: float = Field(
        1000.0,
        ge=0,
        description="unary calls per second per client address, per port (0: no limit)",
    )
    pair_queue: int = Field(
        64,
        ge=1,
        description="Observe messages a pair's queue holds in front of its owner; when it is "
        "full the streams sending to the pair are read no further until there is room "
        "(HTTP/2 flow control holds their senders back; nothing is refused or lost)",
    )
    # 100 ms bounds a pair to 10 refits a second,
    # whatever the fleet's size. bench/bench_refit_gate.py on the shared traces and
    # variants: at 8 workers the measures are unchanged (log loss and ECE within
    # 0.002), at 64 within about 0.005; a 1 s interval cost up to +0.06 ECE there (the
    # estimator takes one damped Newton step per refit, so fewer refits learn slower).
    min_refit_interval_ms: float = Field(
        100.0,
        ge=0,
        description="a pair refits at most this often: a round that fills sooner stays open, "
        "pooling what every worker sends, and refits when the interval is over, so refits "
        "do not grow with the number of workers (0: refit every --refit-interval pooled "
        "steps)",
    )
    # 0 by default: a worker scores its drafts with what it was pushed last, and a
    # paced push leaves it scoring with older coefficients while the pair learns.
    # bench/bench_refit_gate.py --push-s on the shared traces and variants, 64 workers:
    # log loss up to +0.012 over the gate alone at 0.25 s, +0.016 at 1 s. At 1 s, 128
    # workers flat out got 7-9x fewer pushes and took 10-17 % less server CPU per
    # summary (bench/RESULTS.md): a fleet whose CPU matters more may set it.
    push_interval_ms: float = Field(
        0.0,
        ge=0,
        description="an Observe stream gets a pair's new coefficients at most this often: "
        "the latest, when the interval is over (0: after every refit)",
    )
    pair_pushes_per_s: float = Field(
        PAIR_PUSHES_PER_S,
        ge=0,
        description="coefficient pushes a second per pair, its Observe streams together: "
        "with more workers streaming than a tenth of this, each stream gets the latest at "
        "most every workers / this seconds (0: every refit's to every stream)",
    )
    sketched_workers: int = Field(
        SKETCHED_WORKERS,
        ge=0,
        description="workers of a pair whose every round summary carries its calibration "
        "sketch; with more streaming, each sends one in ceil(workers / this) (0: every one)",
    )
    fold_thread_cells: int = Field(
        65536,
        ge=0,
        description="fold a raw step of at least this many draft cells (rows x K) on a worker "
        "thread, so health and coefficients stay prompt (0: always on the event loop)",
    )
    pair_rate: float = Field(
        20000.0,
        ge=0,
        description="unary calls per second naming one pair, all clients together (per "
        "port: the read port counts its own), then RESOURCE_EXHAUSTED (0: no limit)",
    )
    grace_s: float = Field(
        5.0, gt=0.0, description="seconds SIGTERM may take in all (drain, final snapshot, exit)"
    )
    allow_empty_store: bool = Field(
        False,
        description="start even though the state file says the store held pairs and it is "
        "now missing or empty (begin afresh)",
    )
    refuse_empty_store: bool = Field(
        False,
        description="refuse to start on a store with no pairs when no state file records "
        "what it held: a data directory emptied whole or a volume not mounted (its state "
        "file is gone too; a lost database beside a surviving state file is refused "
        "anyway). A first start is such a start too: begin with --allow-empty-store once",
    )
    worker_ttl_s: float = Field(
        86400.0,
        ge=0.0,
        description="forget a worker's sequence record after this many idle seconds (0: never)",
    )
    pair_ttl_s: float = Field(
        0.0,
        ge=0.0,
        description="delete pairs that received no step for this many seconds and have no "
        "open stream (0: never)",
    )
    log_level: str = Field("info", description="debug, info, warning or error")

    @field_validator("default_rule")
    @classmethod
    def _known_rule(cls, v: str) -> str:
        if v not in RULE_NAMES:
            raise ValueError(f"default_rule must be one of {', '.join(RULE_NAMES)}, got {v!r}")
        return v

    @field_validator("store")
    @classmethod
    def _store_location(cls, v: str) -> str:
        if v.strip() and not is_postgres(v):
            raise ValueError(
                "store must be empty (the SQLite file in --data-dir) or a PostgreSQL URL "
                f"postgresql://USER@HOST:PORT/DB, got {v.split('@')[-1]!r}"
            )
        return v.strip()

    @field_validator("grpc_address", "http_address")
    @classmethod
    def _host_port(cls, v: str) -> str:
        split_address(v)
        return v

    @field_validator("read_address")
    @classmethod
    def _optional_host_port(cls, v: str) -> str:
        if v.strip():
            split_address(v.strip())
        return v.strip()

    @model_validator(mode="after")
    def _tls_pair(self) -> Settings:
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ValueError("tls_cert and tls_key go together")
        if self.tls_client_ca and not self.tls_cert:
            raise ValueError("tls_client_ca needs tls_cert and tls_key")
        return self

    @property
    def database(self) -> Path:
        return self.state_config().database

    def state_config(self) -> StateConfig:
        """What the state reads of these settings."""
        return StateConfig(
            data_dir=self.data_dir,
            default_rule=self.default_rule,
            refit_interval=self.refit_interval,
            forgetting=self.forgetting,
            prior=self.prior,
            max_pairs=self.max_pairs,
            flush_interval_ms=self.flush_interval_ms,
            fold_thread_cells=self.fold_thread_cells,
            allow_empty_store=self.allow_empty_store,
            refuse_empty_store=self.refuse_empty_store,
            worker_ttl_s=self.worker_ttl_s,
            pair_ttl_s=self.pair_ttl_s,
            store=self.store,
            replica_name=self.replica_name,
            pair_queue=self.pair_queue,
            min_refit_s=self.min_refit_interval_ms / 1000.0,
        )

    def stream_limits(self) -> StreamLimits:
        """What the gRPC adapter reads of these settings."""
        return StreamLimits(
            max_rows=self.max_rows,
            pair_rate=self.pair_rate,
            max_message_bytes=self.max_message_bytes,
            push_every_s=self.push_interval_ms / 1000.0,
            sketched_workers=self.sketched_workers,
            pair_pushes_per_s=self.pair_pushes_per_s,
        )


def env_name(field_name: str) -> str:
    return ENV_PREFIX + field_name.upper()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """One ``--flag`` per setting; defaults come from the environment."""
    for name, f in Settings.model_fields.items():
        if isinstance(f.default, bool):
            parser.add_argument(
                "--" + name.replace("_", "-"),
                dest=name,
                action="store_const",
                const=True,
                default=None,
                help=f"{f.description} [env {env_name(name)}=1, default off]",
            )
            continue
        parser.add_argument(
            "--" + name.replace("_", "-"),
            dest=name,
            type=type(f.default),
            default=None,
            metavar=name.upper(),
            help=f"{f.description} [env {env_name(name)}, default {f.default!r}]",
        )


def settings_table() -> str:
    """The Markdown table of every setting (flag, variable, default, meaning), as
    docs/settings.md holds it: ``python -m avest.settings`` prints it."""
    rows = ["| flag | environment | default | meaning |", "|---|---|---|---|"]
    for name, f in Settings.model_fields.items():
        flag, env = "--" + name.replace("_", "-"), env_name(name)
        if isinstance(f.default, bool):
            env, default = env + "=1", "off"
        else:
            default = f"`{f.default}`" if f.default != "" else "empty"
        meaning = str(f.description).replace("|", "\\|")
        rows.append(f"| `{flag}` | `{env}` | {default} | {meaning} |")
    return "\n".join(rows) + "\n"


def from_sources(
    args: argparse.Namespace | None = None, env: Mapping[str, str] | None = None
) -> Settings:
    """Flags over ``AVEST_*`` environment over defaults; validates values.

    ``env`` replaces the process environment (for tests).
    """
    flags = {
        name: getattr(args, name)
        for name in Settings.model_fields
        if args is not None and getattr(args, name, None) is not None
    }
    try:
        if env is None:
            return Settings(**flags)
        values: dict[str, Any] = {
            name: env[env_name(name)] for name in Settings.model_fields if env_name(name) in env
        }
        return Settings.model_validate({**values, **flags})
    except ValidationError as exc:
        err = exc.errors()[0]
        name = str(err["loc"][0]) if err["loc"] else "?"
        source = "--" + name.replace("_", "-") if name in flags else env_name(name)
        raise ValueError(f"{source}: {err['msg']}") from None


def split_address(address: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"address must be HOST:PORT, got {address!r}")
    return host.strip("[]") or "0.0.0.0", int(port)


if __name__ == "__main__":
    print(settings_table(), end="")
