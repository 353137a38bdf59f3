"""Embedded persistence: one SQLite file in the data directory.

Tables: ``meta`` (format and the release that wrote it), ``pairs`` (key, rule,
refit interval), ``snapshots`` (the estimator's arrays — coefficients, open
round statistics, calibration state, the update rule's carried information —
as one versioned blob with a checksum, and the last refit outcome),
``workers`` (per-worker sequence watermarks, written only when they change),
``coefficient_history`` (every coefficient change), ``cost_curves`` (per pair
and hardware label) and ``quarantine`` (snapshots that failed to load, kept
aside). Formats and migrations: :mod:`avest.state.store_format`.

A :class:`Store` is used from one thread at a time (the service gives it a
thread of its own). Each :meth:`write` is one transaction, committed with
``synchronous=FULL`` before the batches it covers are acknowledged.

:class:`PairStore` is what the registry calls of a store, whichever holds it:
this file, or a PostgreSQL database (:mod:`avest.state.postgres`); which one a
location names: :mod:`avest.state.stores`.
"""

from __future__ import annotations

import json
import sqlite3
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from avest import __version__
from avest.state.guard import StateFile
from avest.state.store_format import (
    BLOB_FORMAT,
    STORE_FORMAT,
    CorruptSnapshot,
    StoreTooNew,
    begin,
    blob_format,
    checksum,
    migrate,
    not_avest,
    pack_arrays,
    rollback,
    stored_format,
    unpack_arrays,
    written_by,
)

__all__ = [
    "HISTORY_KEPT",
    "Guard",
    "Loaded",
    "NotAStore",
    "PairStore",
    "Store",
    "StoreTooNew",
    "StoreUnreadable",
    "verify_snapshot",
]

#: How many history rows a restored pair keeps in memory.
HISTORY_KEPT = 256


class StoreUnreadable(RuntimeError):
    """The database file itself cannot be opened or read (not one pair: all of it)."""


class NotAStore(StoreUnreadable):
    """The file is a database, but not one avest wrote: refused, nothing written."""


@dataclass
class Loaded:
    """What :meth:`Store.load` found: restorable records and pairs kept aside."""

    records: list[dict[str, Any]] = field(default_factory=list)
    #: ``pair_id -> reason`` for every pair whose stored state failed to load.
    quarantined: dict[str, str] = field(default_factory=dict)


class Guard(Protocol):
    """What catches a lost store at start: it knows how many pairs the store held."""

    def check_loaded(self, loaded_pairs: int, allow_empty: bool) -> None: ...

    def check_unrecorded(self, loaded_pairs: int, refuse: bool, allow_empty: bool) -> None: ...

    def record(self, pairs: int) -> None: ...


class PairStore(Protocol):
    """What the registry calls of a store, from one thread at a time.

    Each :meth:`write` and :meth:`delete` is one transaction: all of it is
    durable when it returns, nothing of it when it raises.
    """

    #: Where it is, for messages (a path, or a URL without its password).
    location: str
    #: The format found on opening (0: a new store); the store is now at the current one.
    found_format: int
    #: A copy kept before a migration, if one ran.
    backup: Path | None

    def load(self) -> Loaded: ...

    def write(self, records: list[dict[str, Any]]) -> None: ...

    def delete(self, pair_id: str) -> None: ...

    def quarantine(self, pair_id: str, reason: str) -> bool: ...

    def rebuild(self, records: list[dict[str, Any]], quarantined: dict[str, str]) -> Path: ...

    def guard(self, data_dir: Path | str) -> Guard: ...

    def history(
        self, pair_id: str, limit: int = 1000
    ) -> list[tuple[int, int, float, float, list[float], str]]: ...

    def close(self) -> None: ...


def verify_snapshot(
    where: str,
    pid: str,
    key_json: str,
    rule: str,
    interval: int,
    blob: bytes,
    fmt: int,
    digest: str,
    outcome: str,
) -> None:
    """Refuse a snapshot row of a newer format, or one that fails its checksum."""
    if max(fmt, blob_format(blob)) > BLOB_FORMAT:
        raise StoreTooNew(
            f"{where}: pair {pid} has snapshot format {max(fmt, blob_format(blob))}; "
            f"avest {__version__} reads formats up to {BLOB_FORMAT}. Nothing was changed."
        )
    if fmt != blob_format(blob):
        raise CorruptSnapshot(f"blob format {blob_format(blob)} but row says {fmt}")
    if digest != checksum(pid, key_json, rule, interval, blob, outcome):
        raise CorruptSnapshot("checksum mismatch")


#: The columns a pair's record is read from, in the order :func:`pair_record` takes
#: them: its row (``pairs`` joined with ``snapshots``), its workers, its cost
#: curves and its newest coefficient history.
PAIR_ROW = (
    "SELECT p.key_json, p.rule, p.refit_interval, s.arrays, s.updated, s.format, "
    "s.checksum, s.last_outcome FROM pairs p JOIN snapshots s ON s.pair_id = p.id "
    "WHERE p.id = {}"
)
WORKER_ROWS = "SELECT worker_id, sequence, seen FROM workers WHERE pair_id = {}"
COST_ROWS = (
    "SELECT hardware, draft_json, verify_json, cudagraph_limit FROM cost_curves WHERE pair_id = {}"
)
NEWEST_HISTORY = (
    "SELECT version, round, time, slope, intercepts_json, outcome FROM coefficient_history "
    "WHERE pair_id = {0} ORDER BY time DESC, round DESC LIMIT {0}"
)


def pair_record(
    where: str,
    pid: str,
    row: Sequence[Any],
    workers: Iterable[Sequence[Any]],
    costs: Iterable[Sequence[Any]],
    newest_history: Sequence[Sequence[Any]],
) -> dict[str, Any]:
    """A stored pair's record from the rows the queries above read (any backend),
    its snapshot checked first (:func:`verify_snapshot`)."""
    key_json, rule, interval, blob, updated, fmt, digest, outcome = row
    blob = bytes(blob)
    verify_snapshot(where, pid, key_json, rule, interval, blob, fmt, digest, outcome)
    return {
        "id": pid,
        "key": json.loads(key_json),
        "rule": rule,
        "refit_interval": interval,
        "arrays": unpack_arrays(blob),
        "last_outcome": outcome,
        "workers": {str(w): (int(s), float(t)) for w, s, t in workers},
        "costs": [
            {
                "hardware": hw,
                "draft": json.loads(d),
                "verify": json.loads(v),
                "cudagraph_limit": lim,
            }
            for hw, d, v, lim in costs
        ],
        "history": [
            {
                "version": v,
                "round": rd,
                "time": t,
                "slope": s,
                "intercepts": json.loads(i),
                "outcome": o,
            }
            for v, rd, t, s, i, o in reversed(newest_history)
        ],
        "updated": updated,
    }


def history_rows(record: dict[str, Any]) -> list[tuple[Any, ...]]:
    """The ``coefficient_history`` rows of a record's new history entries."""
    return [
        (
            record["id"],
            h["version"],
            h["round"],
            h["time"],
            h["slope"],
            json.dumps(list(h["intercepts"])),
            h["outcome"],
        )
        for h in record["history"]
    ]


def cost_rows(record: dict[str, Any]) -> list[tuple[Any, ...]]:
    """The ``cost_curves`` rows of a record's cost curves."""
    return [
        (
            record["id"],
            c["hardware"],
            json.dumps(c["draft"]),
            json.dumps(c["verify"]),
            c["cudagraph_limit"],
        )
        for c in record["costs"]
    ]


class Store:
    """The SQLite file: one implementation of :class:`PairStore`."""

    def __init__(self, path: Path | str) -> None:
        self.path = Path(path)
        self.location = str(self.path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        try:
            self.db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
            foreign = not_avest(self.db)
            found = stored_format(self.db)
        except sqlite3.DatabaseError as exc:
            raise StoreUnreadable(f"{self.path}: {exc}") from exc
        if foreign:
            self.db.close()
            raise NotAStore(
                f"{self.path} {foreign}; refusing to write into it (nothing was changed). "
                "It is not a store avest wrote: give avest a data directory of its own "
                "(--data-dir)."
            )
        if found > STORE_FORMAT:
            by = written_by(self.db)
            self.db.close()
            raise StoreTooNew(
                f"{self.path} has store format {found}, written by {by}; avest {__version__} "
                f"reads formats up to {STORE_FORMAT}. Nothing was read or changed: run the "
                "release that wrote it (or a newer one), or restore a backup from this release."
            )
        #: The format found on opening (0: a new file); the file is now at STORE_FORMAT.
        self.found_format = found
        self.backup: Path | None = None
        try:
            self.db.execute("PRAGMA journal_mode=WAL")
            self.db.execute("PRAGMA synchronous=FULL")
            self.db.execute("PRAGMA foreign_keys=ON")
            if 0 < found < STORE_FORMAT:
                self.backup = self.path.with_name(f"{self.path.name}.format{found}.bak")
                with sqlite3.connect(self.backup) as copy:
                    self.db.backup(copy)
            if found != STORE_FORMAT:
                migrate(self.db, found)
        except sqlite3.DatabaseError as exc:
            raise StoreUnreadable(f"{self.path}: {exc}") from exc

    def close(self) -> None:
        self.db.close()

    def guard(self, data_dir: Path | str) -> StateFile:
        """The state file in ``data_dir`` (:mod:`avest.state.guard`)."""
        return StateFile(data_dir, self.path)

    # -- writing -------------------------------------------------------------------

    def write(self, records: list[dict[str, Any]]) -> None:
        """Persist pair snapshots (from ``Registry.snapshot``) in one transaction."""
        if not records:
            return
        cur = self.db.cursor()
        begin(cur)
        try:
            for r in records:
                self._write_one(cur, r)
            cur.execute("COMMIT")
        except BaseException as exc:
            rollback(self.db, exc)
            raise

    def _write_one(self, cur: sqlite3.Cursor, r: dict[str, Any]) -> None:
        key_json = json.dumps(r["key"], sort_keys=True)
        cur.execute(
            "INSERT INTO pairs (id, key_json, k, rule, refit_interval, updated) VALUES (?,?,?,?,?,?) "
            "ON CONFLICT(id) DO UPDATE SET rule=excluded.rule, refit_interval=excluded.refit_interval, "
            "updated=excluded.updated",
            (r["id"], key_json, r["key"]["k"], r["rule"], r["refit_interval"], r["updated"]),
        )
        counters = r["arrays"]["counters"]
        blob = pack_arrays(r["arrays"])
        outcome = r.get("last_outcome", "")
        cur.execute(
            "INSERT OR REPLACE INTO snapshots (pair_id, arrays, applied_json, version, round, "
            "updated, format, checksum, last_outcome) VALUES (?,?,?,?,?,?,?,?,?)",
            (
                r["id"],
                blob,
                "{}",
                int(counters[0]),
                int(counters[1]),
                r["updated"],
                BLOB_FORMAT,
                checksum(r["id"], key_json, r["rule"], r["refit_interval"], blob, outcome),
                outcome,
            ),
        )
        cur.executemany(
            "INSERT OR REPLACE INTO workers (pair_id, worker_id, sequence, seen) VALUES (?,?,?,?)",
            [(r["id"], w, int(seq), float(seen)) for w, (seq, seen) in r["workers"].items()],
        )
        cur.executemany(
            "DELETE FROM workers WHERE pair_id = ? AND worker_id = ?",
            [(r["id"], w) for w in r.get("pruned", ())],
        )
        cur.executemany(
            "INSERT OR IGNORE INTO coefficient_history VALUES (?,?,?,?,?,?,?)",
            history_rows(r),
        )
        if r.get("history_cleared"):
            cur.execute(
                "DELETE FROM coefficient_history WHERE pair_id = ? AND time < ?",
                (r["id"], r["history_cleared"]),
            )
        cur.executemany("INSERT OR REPLACE INTO cost_curves VALUES (?,?,?,?,?)", cost_rows(r))

    def delete(self, pair_id: str) -> None:
        """Remove every row of a pair (one transaction)."""
        cur = self.db.cursor()
        begin(cur)
        try:
            for table in ("workers", "coefficient_history", "cost_curves", "snapshots"):
                cur.execute(f"DELETE FROM {table} WHERE pair_id = ?", (pair_id,))
            cur.execute("DELETE FROM pairs WHERE id = ?", (pair_id,))
            cur.execute("COMMIT")
        except BaseException as exc:
            rollback(self.db, exc)
            raise

    def quarantine(self, pair_id: str, reason: str) -> bool:
        """Keep a pair's unreadable state aside and free its id; False if that failed.

        What can still be read (its key, its snapshot's bytes) is copied into
        the ``quarantine`` table before its rows are removed.
        """
        key_json = blob = None
        try:
            row = self.db.execute("SELECT key_json FROM pairs WHERE id = ?", (pair_id,)).fetchone()
            key_json = row[0] if row else None
            row = self.db.execute(
                "SELECT arrays FROM snapshots WHERE pair_id = ?", (pair_id,)
            ).fetchone()
            blob = bytes(row[0]) if row else None
        except sqlite3.DatabaseError:
            pass
        try:
            self.db.execute(
                "INSERT OR REPLACE INTO quarantine VALUES (?,?,?,?,?)",
                (pair_id, time.time(), reason, key_json, blob),
            )
            self.delete(pair_id)
        except sqlite3.DatabaseError:
            return False
        return True

    def rebuild(self, records: list[dict[str, Any]], quarantined: dict[str, str]) -> Path:
        """Salvage: a fresh file holding ``records``, the damaged one kept aside.

        For a file whose damaged pages cannot even be deleted: every readable
        pair (as loaded) is written into a new file at :attr:`path`, with the
        quarantined ids and reasons in its ``quarantine`` table; the old file
        (and its WAL) is renamed ``<name>.corrupt-<unix time>``. Returns that name.
        """
        self.db.close()
        aside = self.path.with_name(f"{self.path.name}.corrupt-{int(time.time())}")
        for suffix in ("", "-wal", "-shm"):
            src = Path(f"{self.path}{suffix}")
            if src.exists():
                src.rename(Path(f"{aside}{suffix}"))
        fresh = Store(self.path)
        fresh.write(records)
        fresh.db.executemany(
            "INSERT OR REPLACE INTO quarantine (pair_id, time, reason) VALUES (?,?,?)",
            [
                (pid, time.time(), f"{why} (file kept as {aside.name})")
                for pid, why in quarantined.items()
            ],
        )
        self.db, self.backup = fresh.db, None
        return aside

    # -- reading ---------------------------------------------------------------------

    def load(self) -> Loaded:
        """Every pair's last snapshot, in the form ``Registry.restore`` takes.

        A pair whose rows cannot be read, fail their checksum or do not decode
        is reported in :attr:`Loaded.quarantined` instead; the others load.
        """
        out = Loaded()
        try:
            ids = [r[0] for r in self.db.execute("SELECT id FROM pairs ORDER BY id")]
        except sqlite3.DatabaseError as exc:
            raise StoreUnreadable(f"{self.path}: the pairs table is unreadable: {exc}") from exc
        for pid in ids:
            try:
                record = self._load_one(pid)
            except StoreTooNew:
                raise
            except (sqlite3.DatabaseError, CorruptSnapshot, ValueError, KeyError) as exc:
                out.quarantined[pid] = f"{type(exc).__name__}: {exc}"
                continue
            if record is not None:
                out.records.append(record)
        return out

    def _load_one(self, pid: str) -> dict[str, Any] | None:
        row = self.db.execute(PAIR_ROW.format("?"), (pid,)).fetchone()
        if row is None:
            return None  # registered, never snapshotted (0.1.0 wrote both at once)
        return pair_record(
            str(self.path),
            pid,
            row,
            self.db.execute(WORKER_ROWS.format("?"), (pid,)).fetchall(),
            self.db.execute(COST_ROWS.format("?"), (pid,)).fetchall(),
            self.db.execute(NEWEST_HISTORY.format("?"), (pid, HISTORY_KEPT)).fetchall(),
        )

    def history(
        self, pair_id: str, limit: int = 1000
    ) -> list[tuple[int, int, float, float, list[float], str]]:
        rows = self.db.execute(
            "SELECT version, round, time, slope, intercepts_json, outcome FROM coefficient_history "
            "WHERE pair_id = ? ORDER BY time, round LIMIT ?",
            (pair_id, limit),
        ).fetchall()
        return [(v, r, t, s, json.loads(i), o) for v, r, t, s, i, o in rows]
