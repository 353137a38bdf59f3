"""Which store a location names: the SQLite file, or a PostgreSQL database.

A location is a PostgreSQL URL (``postgresql://USER@HOST:PORT/DB``, or
``postgres://``), or a path: a SQLite file, or a data directory holding
``avest.sqlite3``. The service's default (``--store`` empty) is the SQLite file
in ``--data-dir``, which needs no other service.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from avest.state.config import DATABASE_NAME, StateConfig
from avest.state.guard import StateFile
from avest.state.store import PairStore, Store
from avest.state.store_format import checksum, pack_arrays

#: The URL schemes libpq takes for a PostgreSQL server.
POSTGRES_SCHEMES = ("postgresql://", "postgres://")


class StoreNotFound(FileNotFoundError):
    """A path named as a store to read holds no store."""


def is_postgres(location: str) -> bool:
    return location.strip().lower().startswith(POSTGRES_SCHEMES)


def open_configured(config: StateConfig) -> PairStore:
    """The service's store: the PostgreSQL database ``config.store`` names, else the
    SQLite file in the data directory (refused first if the state file says it held
    pairs and it is gone: :mod:`avest.state.guard`)."""
    if is_postgres(config.store):
        return open_location(config.store, create=True)
    StateFile(config.data_dir, config.database).check_present(
        config.allow_empty_store, config.refuse_empty_store
    )
    return open_location(str(config.database), create=True)


def sqlite_path(location: str) -> Path:
    """The SQLite file a path names: itself, or ``avest.sqlite3`` in a directory."""
    path = Path(location)
    return path / DATABASE_NAME if path.is_dir() else path


def open_location(location: str, create: bool) -> PairStore:
    """The store at ``location``; a SQLite file that does not exist is made only
    when ``create`` (a store to read must be there)."""
    if is_postgres(location):
        from avest.state.postgres import PostgresStore

        return PostgresStore(location)
    path = sqlite_path(location)
    if not create and (not path.is_file() or path.stat().st_size == 0):
        raise StoreNotFound(f"{path}: no avest store there")
    return Store(path)


#: Pairs per write transaction of a copy: a few K = 64 snapshots (tens of kB each
#: compressed) per commit, so no one transaction holds a whole large store.
COPY_CHUNK = 16
#: Every history row: the store keeps them all (a restored pair only the newest).
ALL_HISTORY = 2**62


class CopyRefused(RuntimeError):
    """A copy that would lose or overwrite something, or whose result differs."""


def record_digest(record: dict[str, Any]) -> str:
    """SHA-256 over what a stored pair restores: its snapshot row's checksum (the
    same one the store keeps), its workers, cost curves and update time."""
    key_json = json.dumps(record["key"], sort_keys=True)
    blob = pack_arrays(record["arrays"])
    row = checksum(
        record["id"],
        key_json,
        record["rule"],
        record["refit_interval"],
        blob,
        record.get("last_outcome", ""),
    )
    rest = json.dumps(
        [
            sorted([w, list(v)] for w, v in record["workers"].items()),
            sorted(json.dumps(c, sort_keys=True) for c in record["costs"]),
            record["updated"],
        ]
    )
    return hashlib.sha256((row + rest).encode()).hexdigest()


def copy_pairs(source: PairStore, target: PairStore, force: bool = False) -> list[str]:
    """Copy every pair of ``source`` (snapshot, workers, cost curves, whole history)
    into ``target``, then read both back and compare; the ids copied.

    Refused before anything is written when a source pair fails its checks, or
    when ``target`` holds pairs and not ``force`` (with it, they are deleted first).
    """
    if source.location == target.location:
        raise CopyRefused(f"{source.location} is both the source and the target")
    loaded = source.load()
    if loaded.quarantined:
        bad = "; ".join(f"{pid}: {why}" for pid, why in loaded.quarantined.items())
        raise CopyRefused(
            f"{source.location}: pair(s) fail their checks ({bad}); nothing was copied"
        )
    held = target.load()
    there = [r["id"] for r in held.records] + list(held.quarantined)
    if there and not force:
        raise CopyRefused(
            f"{target.location} already holds {len(there)} pair(s); nothing was copied "
            "(--force deletes them first)"
        )
    for pid in there:
        target.delete(pid)
    records = loaded.records
    for r in records:
        r["history"] = [
            {"version": v, "round": rd, "time": t, "slope": s, "intercepts": i, "outcome": o}
            for v, rd, t, s, i, o in source.history(r["id"], ALL_HISTORY)
        ]
    for start in range(0, len(records), COPY_CHUNK):
        target.write(records[start : start + COPY_CHUNK])
    copied = target.load()
    if copied.quarantined:
        raise CopyRefused(
            f"{target.location}: copied pair(s) fail their checks: {copied.quarantined}"
        )
    want = {r["id"]: record_digest(r) for r in records}
    got = {r["id"]: record_digest(r) for r in copied.records}
    differ = sorted(pid for pid in want.keys() | got.keys() if want.get(pid) != got.get(pid))
    differ += sorted(
        pid
        for pid in want
        if pid not in differ
        and sorted(map(repr, source.history(pid, ALL_HISTORY)))
        != sorted(map(repr, target.history(pid, ALL_HISTORY)))
    )
    if differ:
        raise CopyRefused(f"{target.location}: pair(s) differ from the source: {', '.join(differ)}")
    return sorted(want)
