"""Embedded persistence: one SQLite file in the data directory.

Tables: ``meta`` (format and the release that wrote it), ``pairs`` (key, rule,
refit interval), ``snapshots`` (the estimator's arrays — coefficients, open
round statistics, calibration state, the update rule's carried information —
as one versioned blob with a checksum, and the last refit outcome),
``workers`` (per-worker sequence watermarks, written only when they change),
``coefficient_history`` (every coefficient change), ``cost_curves`` (per pair
and hardware label) and ``quarantine`` (snapshots that failed to load, kept
aside). Formats and migrations: :mod:`avest.state.store_format`.

What a starting service reads (:meth:`Store.load_at_start`) is checked first
(``PRAGMA integrity_check``). Damage the file can repair itself is repaired: an
index is rebuilt in place (``REINDEX``), or, when its pages cannot even be read,
every row is copied with the indexes bypassed into a fresh file that passes the
check (the damaged one kept aside, unchanged). Damage to rows is narrowed down to
the pairs whose own rows cannot be read: they alone are quarantined, and a file
that cannot be repaired is rebuilt from the readable pairs without anything being
written into it first. A disk that answers with an I/O error is no damage: nothing
is quarantined or set aside for it (:class:`StoreIOError`, "store I/O error: ...").

A :class:`Store` is used from one thread at a time (the service gives it a
thread of its own). Each :meth:`write` is one transaction, committed with
``synchronous=FULL`` before the batches it covers are acknowledged.

:class:`PairStore` is what the registry calls of a store, whichever holds it:
this file, or a PostgreSQL database (:mod:`avest.state.postgres`); which one a
location names: :mod:`avest.state.stores`.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import re
import sqlite3
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from avest import __version__
from avest.state.guard import StateFile
from avest.state.store_format import (
    BLOB_FORMAT,
    STORE_FORMAT,
    TABLES,
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
    "StoreIOError",
    "StoreTooNew",
    "StoreUnreadable",
    "error_kind",
    "verify_snapshot",
]

log = logging.getLogger("avest")

#: How many history rows a restored pair keeps in memory.
HISTORY_KEPT = 256


class StoreUnreadable(RuntimeError):
    """The database file itself cannot be opened or read (not one pair: all of it)."""


class NotAStore(StoreUnreadable):
    """The file is a database, but not one avest wrote: refused, nothing written."""


class StoreIOError(StoreUnreadable):
    """The disk answered a read or a write with an I/O error (EIO, EFBIG, ...).

    Not damage: the file may be intact, so nothing is quarantined, repaired or set
    aside for it. Its message starts "store I/O error: ".
    """


def error_kind(exc: BaseException) -> str:
    """What an SQLite error says failed: ``"io"`` (SQLITE_IOERR: the disk refused a
    read or write), ``"full"``, ``"corrupt"`` (SQLITE_CORRUPT, SQLITE_NOTADB: the
    file's bytes), ``"readonly"``, or ``""`` for anything else.

    Read from ``sqlite_errorname`` (Python 3.11+), else from the primary result
    code, else from SQLite's message. SQLite reports EIO on a *read* as
    SQLITE_CORRUPT, not SQLITE_IOERR (its Unix VFS returns SQLITE_IOERR_CORRUPTFS,
    which the API turns into SQLITE_CORRUPT): :meth:`Store.describe` reads the file
    itself to tell the two apart.
    """
    name = str(getattr(exc, "sqlite_errorname", "") or "")
    code = getattr(exc, "sqlite_errorcode", None)
    if not name and isinstance(code, int):
        name = _PRIMARY.get(code & 0xFF, "")
    if name:
        for prefix, kind in _KINDS:
            if name.startswith(prefix):
                return kind
        return ""
    text = str(exc)
    for words, kind in _MESSAGES:
        if words in text:
            return kind
    return ""


_PRIMARY = {8: "SQLITE_READONLY", 10: "SQLITE_IOERR", 11: "SQLITE_CORRUPT", 13: "SQLITE_FULL",
            26: "SQLITE_NOTADB"}  # fmt: skip
_KINDS = (
    ("SQLITE_IOERR", "io"),
    ("SQLITE_FULL", "full"),
    ("SQLITE_CORRUPT", "corrupt"),
    ("SQLITE_NOTADB", "corrupt"),
    ("SQLITE_READONLY", "readonly"),
)
_MESSAGES = (
    ("disk I/O error", "io"),
    ("database or disk is full", "full"),
    ("malformed", "corrupt"),
    ("file is not a database", "corrupt"),
    ("readonly database", "readonly"),
)
#: Bytes read at a time when the file itself is read to find an I/O error.
PROBE_CHUNK = 1 << 20


@dataclass
class Loaded:
    """What :meth:`Store.load` found: restorable records and pairs kept aside."""

    records: list[dict[str, Any]] = field(default_factory=list)
    #: ``pair_id -> reason`` for every pair whose stored state failed to load.
    quarantined: dict[str, str] = field(default_factory=dict)
    #: ``pair_id -> reason`` for pairs set aside at an earlier start (the
    #: ``quarantine`` table) that no pair of that id has replaced: they stay set
    #: aside until an admin deletes them. Only :meth:`Store.load_at_start` reads them.
    set_aside: dict[str, str] = field(default_factory=dict)
    #: ``pair_id -> "store I/O error: ..."`` for pairs whose rows the disk refused
    #: to read (:meth:`Store.load_at_start`): not damage, so their rows are left as
    #: they are and read again at the next start.
    unreadable: dict[str, str] = field(default_factory=dict)
    #: What the check at start found and repaired ("" when nothing was wrong).
    repaired: str = ""
    #: Damage the check found and could not repair: the file is to be rebuilt from
    #: the readable pairs (:meth:`PairStore.rebuild`), nothing written into it first.
    damaged: str = ""


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
        #: While one load or check runs: whether the file reads back ([] until read).
        self._fault_memo: list[OSError | None] | None = None
        try:
            self.db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
            foreign = not_avest(self.db)
            found = stored_format(self.db)
        except sqlite3.DatabaseError as exc:
            raise self._unreadable(exc) from exc
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
            self._configure()
            if 0 < found < STORE_FORMAT:
                self.backup = self.path.with_name(f"{self.path.name}.format{found}.bak")
                with sqlite3.connect(self.backup) as copy:
                    self.db.backup(copy)
            if found != STORE_FORMAT:
                migrate(self.db, found)
        except sqlite3.DatabaseError as exc:
            raise self._unreadable(exc) from exc

    def _configure(self) -> None:
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA synchronous=FULL")
        self.db.execute("PRAGMA foreign_keys=ON")

    def close(self) -> None:
        self.db.close()

    def guard(self, data_dir: Path | str) -> StateFile:
        """The state file in ``data_dir`` (:mod:`avest.state.guard`)."""
        return StateFile(data_dir, self.path)

    # -- what failed -----------------------------------------------------------------

    def describe(self, exc: BaseException) -> BaseException:
        """``exc`` as what failed: a :class:`StoreIOError` when the disk refused a read
        or a write, else ``exc`` itself.

        The disk refused when SQLite says SQLITE_IOERR, and when it says the file is
        malformed but reading the file's bytes back fails (SQLite reports EIO on a
        read as SQLITE_CORRUPT: :func:`error_kind`).
        """
        kind = error_kind(exc)
        if kind == "io":
            name = getattr(exc, "sqlite_errorname", "")
            return StoreIOError(
                f"store I/O error: {self.path}: {exc}" + (f" ({name})" if name else "")
            )
        if kind == "corrupt":
            fault = self.read_fault()
            if fault is not None:
                code = errno.errorcode.get(fault.errno or 0, "OSError")
                return StoreIOError(
                    f"store I/O error: {self.path}: reading the file back fails with {code} "
                    f"({fault.strerror or fault}); SQLite reports such a read as SQLITE_CORRUPT"
                )
        return exc

    def read_fault(self) -> OSError | None:
        """The error reading the file and its WAL back gives, or None when every byte
        reads (remembered while one load or check runs)."""
        if self._fault_memo:
            return self._fault_memo[0]
        fault = None
        for name in (self.path, Path(f"{self.path}-wal")):
            try:
                read_back(name)
            except FileNotFoundError:
                continue
            except OSError as exc:
                fault = exc
                break
        if self._fault_memo is not None:
            self._fault_memo.append(fault)
        return fault

    def _raise_io(self, exc: BaseException) -> None:
        """Raise :class:`StoreIOError` from ``exc`` when the disk refused."""
        described = self.describe(exc)
        if isinstance(described, StoreIOError):
            raise described from exc

    def _unreadable(self, exc: BaseException) -> StoreUnreadable:
        described = self.describe(exc)
        if isinstance(described, StoreIOError):
            return described
        return StoreUnreadable(f"{self.path}: {exc}")

    @contextlib.contextmanager
    def _transaction(self) -> Iterator[sqlite3.Cursor]:
        """One write transaction: committed whole, or rolled back and its error
        raised (a :class:`StoreIOError` when the disk refused)."""
        cur = self.db.cursor()
        try:
            begin(cur)
            yield cur
            cur.execute("COMMIT")
        except BaseException as exc:
            rollback(self.db, exc)
            if isinstance(exc, sqlite3.Error):
                self._raise_io(exc)
            raise

    # -- writing -------------------------------------------------------------------

    def write(self, records: list[dict[str, Any]]) -> None:
        """Persist pair snapshots (from ``Registry.snapshot``) in one transaction."""
        if not records:
            return
        with self._transaction() as cur:
            for r in records:
                self._write_one(cur, r)

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
        """Remove every row of a pair, and what the ``quarantine`` table kept of it
        (one transaction): its id is free again."""
        with self._transaction() as cur:
            _delete_rows(cur, pair_id)
            cur.execute("DELETE FROM quarantine WHERE pair_id = ?", (pair_id,))

    def quarantine(self, pair_id: str, reason: str) -> bool:
        """Keep a pair's unreadable state aside and remove its rows; False when the
        file's damage keeps that from being done (then nothing of it was written).

        What can still be read (its key, its snapshot's bytes) is copied into the
        ``quarantine`` table in the transaction that removes its rows. A disk that
        refuses the write (an I/O error, full, read-only) is no damage of the file:
        its error rises (:class:`StoreIOError` for an I/O error).
        """
        key_json = self._readable(f"SELECT key_json FROM pairs{NOT_INDEXED} WHERE id = ?", pair_id)
        blob = self._readable(
            f"SELECT arrays FROM snapshots{NOT_INDEXED} WHERE pair_id = ?", pair_id
        )
        try:
            with self._transaction() as cur:
                cur.execute(
                    "INSERT OR REPLACE INTO quarantine VALUES (?,?,?,?,?)",
                    (pair_id, time.time(), reason, key_json, _bytes(blob)),
                )
                _delete_rows(cur, pair_id)
        except sqlite3.DatabaseError as exc:
            if error_kind(exc) == "corrupt":
                return False
            raise
        return True

    def _readable(self, sql: str, pair_id: str) -> Any:
        """The first column of the first row ``sql`` reads, the indexes used, then
        bypassed (``sql`` holds ``{NOT_INDEXED}``'s place); None when it cannot be read."""
        for bypass in ("", " NOT INDEXED"):
            try:
                row = self.db.execute(sql.replace(NOT_INDEXED, bypass), (pair_id,)).fetchone()
            except sqlite3.DatabaseError as exc:
                self._raise_io(exc)
                continue
            return row[0] if row else None
        return None

    def rebuild(self, records: list[dict[str, Any]], quarantined: dict[str, str]) -> Path:
        """Salvage: a fresh file holding ``records``, the damaged one kept aside unchanged.

        For a file whose damage cannot be repaired: nothing is written into it. Every
        readable pair (as loaded, with all of its coefficient history that can still be
        read) is written into a new file at :attr:`path`; its ``quarantine`` table
        holds the rows of the old one that can be read and the ``quarantined`` ids with
        their reasons (and their key and snapshot bytes where they can be read). The
        old file (and its WAL) is renamed ``<name>.corrupt-<unix time>``: that name is
        returned.
        """
        kept = self._kept_rows()
        new = [
            (
                pid,
                why,
                self._readable(f"SELECT key_json FROM pairs{NOT_INDEXED} WHERE id = ?", pid),
                _bytes(
                    self._readable(
                        f"SELECT arrays FROM snapshots{NOT_INDEXED} WHERE pair_id = ?", pid
                    )
                ),
            )
            for pid, why in quarantined.items()
        ]
        whole = []
        for r in records:
            history = self._whole_history(r["id"])
            longer = history is not None and len(history) > len(r["history"])
            whole.append({**r, "history": history} if longer else r)
        aside = self._set_file_aside()
        now = time.time()
        kept += [(p, now, f"{why} (file kept as {aside.name})", k, b) for p, why, k, b in new]
        fresh = Store(self.path)
        try:
            fresh.write(whole)
            with fresh._transaction() as cur:
                cur.executemany("INSERT OR REPLACE INTO quarantine VALUES (?,?,?,?,?)", kept)
        except BaseException:
            fresh.close()
            raise
        self.db, self.backup = fresh.db, None
        return aside

    def _kept_rows(self) -> list[tuple[Any, ...]]:
        """The rows of the ``quarantine`` table that can be read."""
        for bypass in ("", " NOT INDEXED"):
            try:
                rows = self.db.execute(
                    f"SELECT pair_id, time, reason, key_json, arrays FROM quarantine{bypass}"
                ).fetchall()
            except sqlite3.DatabaseError as exc:
                self._raise_io(exc)
                continue
            return [(p, t, why, k, _bytes(b)) for p, t, why, k, b in rows]
        log.warning("%s: the quarantine table cannot be read; its rows are not kept", self.path)
        return []

    def _whole_history(self, pair_id: str) -> list[dict[str, Any]] | None:
        """Every coefficient history entry of a pair that can be read (None if none can)."""
        for bypass in ("", " NOT INDEXED"):
            try:
                rows = self.db.execute(
                    f"SELECT version, round, time, slope, intercepts_json, outcome FROM "
                    f"coefficient_history{bypass} WHERE pair_id = ? ORDER BY time, round",
                    (pair_id,),
                ).fetchall()
            except sqlite3.DatabaseError as exc:
                self._raise_io(exc)
                continue
            return [
                {"version": v, "round": rd, "time": t, "slope": s,
                 "intercepts": json.loads(i), "outcome": o}
                for v, rd, t, s, i, o in rows
            ]  # fmt: skip
        return None

    def _set_file_aside(self) -> Path:
        """Close the file and rename it (and its WAL) ``<name>.corrupt-<unix time>``."""
        self.db.close()
        aside = self.path.with_name(f"{self.path.name}.corrupt-{int(time.time())}")
        n = 1
        while aside.exists():
            aside = self.path.with_name(f"{self.path.name}.corrupt-{int(time.time())}-{n}")
            n += 1
        for suffix in ("", "-wal", "-shm"):
            src = Path(f"{self.path}{suffix}")
            if src.exists():
                src.rename(Path(f"{aside}{suffix}"))
        _sync_directory(self.path.parent)
        return aside

    # -- the check at start --------------------------------------------------------------

    def check_and_repair(self) -> tuple[str, str]:
        """Check the file (``PRAGMA integrity_check``) and repair what it can:
        ``(what was found and repaired, the damage left)``, both "" for a sound file.

        Indexes are rebuilt in place (``REINDEX``, kept only when the check then
        passes); when that fails (their own pages unreadable), every row is read with
        the indexes bypassed and copied into a fresh file, put in place of this one
        (kept aside, unchanged) once it passes the check and holds every row. Damage
        left means rows cannot be read: see :meth:`rebuild`. An I/O error is no
        damage: nothing is repaired or set aside for it (logged, "" returned).
        """
        self._fault_memo = []
        try:
            found = self._integrity()
            if not found:
                return "", ""
            said = _summary(found)
            log.warning("store %s fails PRAGMA integrity_check: %s", self.path, said)
            if self._reindex():
                return (
                    f"PRAGMA integrity_check found {said}; REINDEX rebuilt the indexes and "
                    "the check passes",
                    "",
                )
            aside = self._copy_whole()
            if aside is not None:
                return (
                    f"PRAGMA integrity_check found {said}; REINDEX could not rebuild the "
                    "indexes in place, so every row, read with the indexes bypassed, was "
                    "copied into a fresh file that passes the check; the damaged file is "
                    f"kept, unchanged, as {aside.name}",
                    "",
                )
            return "", said
        except StoreIOError as exc:
            log.error("%s; the store was not checked (nothing repaired or set aside)", exc)
            return "", ""
        finally:
            self._fault_memo = None

    def _integrity(self, db: sqlite3.Connection | None = None) -> list[str]:
        """What ``PRAGMA integrity_check`` finds wrong ([] for a sound file), the
        pages it names that are the root of a table or index named too. When the
        check itself fails (a page it cannot even parse), ``PRAGMA quick_check``
        says where."""
        db = db or self.db
        lines: list[str] = []
        for pragma in ("integrity_check", "quick_check"):
            try:
                rows = db.execute(f"PRAGMA {pragma}").fetchall()
            except sqlite3.DatabaseError as exc:
                if db is self.db:
                    self._raise_io(exc)
                lines = lines or [str(exc)]
                continue
            lines = [
                line
                for (text,) in rows
                for line in str(text).splitlines()
                if line.strip() and not line.startswith("*** in database")
            ]
            break
        if lines == ["ok"]:
            return []
        try:
            roots = {
                int(page): f"{kind} {name}"
                for kind, name, page in db.execute(
                    "SELECT type, name, rootpage FROM sqlite_master WHERE rootpage > 0"
                )
            }
        except sqlite3.DatabaseError:
            return lines

        def named(m: re.Match[str]) -> str:
            root = roots.get(int(m.group(2)))
            return f"{m.group(0)} (the root of {root})" if root else m.group(0)

        return [re.sub(r"\b([Pp]age) (\d+)", named, line) for line in lines]

    def _reindex(self) -> bool:
        """REINDEX, kept only if the file then passes its check (else rolled back)."""
        cur = self.db.cursor()
        try:
            begin(cur)
            cur.execute("REINDEX")
            if self._integrity():
                rollback(self.db, RuntimeError("REINDEX did not repair the file"))
                return False
            cur.execute("COMMIT")
        except BaseException as exc:
            rollback(self.db, exc)
            if isinstance(exc, sqlite3.DatabaseError):
                self._raise_io(exc)
                log.warning("store %s: REINDEX failed: %s", self.path, exc)
                return False
            raise
        return True

    def _copy_whole(self) -> Path | None:
        """Every row of every table, read with the indexes bypassed, into a fresh file
        put in place of this one (kept aside, unchanged); its name, or None (nothing
        changed) when a row cannot be read or the copy fails its check."""
        fresh_path = self.path.with_name(f"{self.path.name}.repair-{os.getpid()}")
        _remove_database(fresh_path)
        fresh = sqlite3.connect(fresh_path, isolation_level=None)
        try:
            fresh.execute("PRAGMA journal_mode=WAL")
            fresh.execute("PRAGMA synchronous=FULL")
            migrate(fresh, 0)
            copied: dict[str, int] = {}
            cur = fresh.cursor()
            begin(cur)
            for table in sorted(TABLES, key=lambda t: (t != "pairs", t)):
                columns = ", ".join(r[1] for r in self.db.execute(f"PRAGMA table_info({table})"))
                places = ", ".join("?" * len(columns.split(", ")))
                verb = "INSERT OR IGNORE" if table == "meta" else "INSERT"
                rows = self.db.execute(f"SELECT {columns} FROM {table} NOT INDEXED")
                copied[table] = 0
                while batch := rows.fetchmany(256):
                    cur.executemany(f"{verb} INTO {table} ({columns}) VALUES ({places})", batch)
                    copied[table] += len(batch)
            cur.execute("COMMIT")
            left = self._integrity(fresh)
            held = {t: fresh.execute(f"SELECT COUNT(*) FROM {t}").fetchone()[0] for t in copied}
            fresh.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        except sqlite3.DatabaseError as exc:
            fresh.close()
            _remove_database(fresh_path)
            self._raise_io(exc)
            log.warning("store %s: a copy of every row failed: %s", self.path, exc)
            return None
        fresh.close()
        if left or any(held[t] != n for t, n in copied.items() if t != "meta"):
            _remove_database(fresh_path)
            log.warning("store %s: the copy of every row fails its check: %s", self.path, left)
            return None
        aside = self._set_file_aside()
        os.replace(fresh_path, self.path)
        _sync_directory(self.path.parent)
        self.db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
        self._configure()
        return aside

    # -- reading ---------------------------------------------------------------------

    def load(self) -> Loaded:
        """Every pair's last snapshot, in the form ``Registry.restore`` takes.

        A pair whose rows cannot be read (the indexes used, then bypassed), fail
        their checksum or do not decode is reported in :attr:`Loaded.quarantined`
        instead; the others load. A disk that refuses a read raises
        :class:`StoreIOError` (nothing is quarantined for it).
        """
        return self._load(io_errors_per_pair=False)

    def load_at_start(self) -> Loaded:
        """What a starting service reads: the file checked and repaired where it can
        be (:meth:`check_and_repair`, its outcome in :attr:`Loaded.repaired` and
        :attr:`Loaded.damaged`), then every pair as :meth:`load` reads it, except
        that a pair whose rows the disk refuses to read is reported in
        :attr:`Loaded.unreadable` (its rows left as they are), and the pairs set
        aside at earlier starts in :attr:`Loaded.set_aside`."""
        repaired, damaged = self.check_and_repair()
        out = self._load(io_errors_per_pair=True)
        out.repaired, out.damaged = repaired, damaged
        try:
            held = set(self._ids())
            for pid, _, why, _, _ in sorted(self._kept_rows(), key=lambda row: row[1]):
                if pid not in held:  # an id registered again since (releases before
                    # this one allowed that) is no longer set aside
                    out.set_aside[pid] = why
        except StoreIOError as exc:
            log.error("%s; the pairs set aside earlier are not known", exc)
        return out

    def _load(self, io_errors_per_pair: bool) -> Loaded:
        out = Loaded()
        self._fault_memo = []
        try:
            for pid in self._ids():
                try:
                    record = self._read_pair(pid)
                except StoreIOError as exc:
                    if not io_errors_per_pair:
                        raise
                    out.unreadable[pid] = str(exc)
                    continue
                except (sqlite3.DatabaseError, CorruptSnapshot, ValueError, KeyError) as exc:
                    out.quarantined[pid] = f"{type(exc).__name__}: {exc}"
                    continue
                if record is not None:
                    out.records.append(record)
        finally:
            self._fault_memo = None
        return out

    def _ids(self) -> list[str]:
        """Every pair's id (the index used, then bypassed)."""
        try:
            return [r[0] for r in self.db.execute("SELECT id FROM pairs ORDER BY id")]
        except sqlite3.DatabaseError as exc:
            self._raise_io(exc)
        try:
            return [r[0] for r in self.db.execute("SELECT id FROM pairs NOT INDEXED ORDER BY id")]
        except sqlite3.DatabaseError as exc:
            self._raise_io(exc)
            raise StoreUnreadable(f"{self.path}: the pairs table is unreadable: {exc}") from exc

    def _read_pair(self, pid: str) -> dict[str, Any] | None:
        """A pair's record, its rows read through the indexes, or with them bypassed
        when that fails (a damaged index); the second failure rises."""
        try:
            return self._load_one(pid)
        except sqlite3.DatabaseError as exc:
            self._raise_io(exc)
        try:
            return self._load_one(pid, bypass=True)
        except sqlite3.DatabaseError as exc:
            self._raise_io(exc)
            raise

    def _load_one(self, pid: str, bypass: bool = False) -> dict[str, Any] | None:
        queries = BYPASSING if bypass else READING
        row = self.db.execute(queries[0], (pid,)).fetchone()
        if row is None:
            return None  # registered, never snapshotted (0.1.0 wrote both at once)
        return pair_record(
            str(self.path),
            pid,
            row,
            self.db.execute(queries[1], (pid,)).fetchall(),
            self.db.execute(queries[2], (pid,)).fetchall(),
            self.db.execute(queries[3], (pid, HISTORY_KEPT)).fetchall(),
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


#: Where " NOT INDEXED" goes in a query that reads a table with its indexes used or not.
NOT_INDEXED = "{not_indexed}"


def _bypassing(sql: str, *tables: str) -> str:
    """``sql`` reading ``tables`` with their indexes bypassed (``NOT INDEXED``)."""
    for table in tables:
        sql, n = re.subn(rf"((?:FROM|JOIN) {table}(?: [a-z])?)(?= )", r"\1 NOT INDEXED", sql)
        assert n == 1, (table, sql)
    return sql


#: A pair's rows as :meth:`Store._load_one` reads them: through the indexes, and
#: with them bypassed (a full scan of each table: slower, for a damaged index).
READING = (
    PAIR_ROW.format("?"),
    WORKER_ROWS.format("?"),
    COST_ROWS.format("?"),
    NEWEST_HISTORY.format("?"),
)
BYPASSING = (
    _bypassing(READING[0], "pairs", "snapshots"),
    _bypassing(READING[1], "workers"),
    _bypassing(READING[2], "cost_curves"),
    _bypassing(READING[3], "coefficient_history"),
)


def _delete_rows(cur: sqlite3.Cursor, pair_id: str) -> None:
    """A pair's rows (not what the ``quarantine`` table keeps of it)."""
    for table in ("workers", "coefficient_history", "cost_curves", "snapshots"):
        cur.execute(f"DELETE FROM {table} WHERE pair_id = ?", (pair_id,))
    cur.execute("DELETE FROM pairs WHERE id = ?", (pair_id,))


def _bytes(blob: Any) -> bytes | None:
    return None if blob is None else bytes(blob)


def _summary(problems: list[str], shown: int = 5) -> str:
    said = "; ".join(problems[:shown])
    more = len(problems) - shown
    return said + (f" (and {more} more)" if more > 0 else "")


def read_back(path: Path) -> None:
    """Read every byte of a file (an :class:`OSError` when the disk refuses)."""
    with path.open("rb", buffering=0) as f:
        while f.read(PROBE_CHUNK):
            pass


def _remove_database(path: Path) -> None:
    for suffix in ("", "-wal", "-shm", "-journal"):
        Path(f"{path}{suffix}").unlink(missing_ok=True)


def _sync_directory(directory: Path) -> None:
    """Make renames in ``directory`` durable (where the platform allows)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
