"""The store's format: versions, the snapshot blob, checksums and migrations.

Two numbers say what a store holds:

- :data:`STORE_FORMAT`, the layout of the SQLite file (tables and columns),
  kept in ``PRAGMA user_version`` and in the ``meta`` table, with the release
  that last wrote the file;
- :data:`BLOB_FORMAT`, the layout of one pair's snapshot blob, kept in the
  blob's own header (``AVST`` + a 16-bit version) and in its row.

Format 1 is the first release's (0.1.0): ``user_version`` 0, no ``meta`` table,
bare ``.npz`` blobs (format 2: zlib-compressed after the header), per-worker sequences as one JSON object per snapshot, no
checksums. Format 2 adds the header, a SHA-256 checksum per snapshot row (over
everything the row restores), the pair's last refit outcome, and a ``workers``
table written only for the workers that changed.

Opening a store runs every forward migration from its format to the current
one in one transaction (a copy of the file is kept beside it first). A store
whose format is newer than this release knows is refused before anything is
read, and so is a file avest did not write (someone else's tables or
``user_version``: :func:`not_avest`), before anything is written into it. To
change a format: bump the number, add a step to
:data:`SCHEMA_MIGRATIONS` (file layout) or :data:`BLOB_MIGRATIONS` (arrays of
one snapshot), and a test that opens a store of the previous format.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import re
import sqlite3
import struct
import zlib
from collections.abc import Callable

import numpy as np

from avest import __version__

log = logging.getLogger("avest")

#: Layout of the SQLite file this release writes (and the newest it reads).
STORE_FORMAT = 2
#: Layout of a snapshot blob this release writes (and the newest it reads).
BLOB_FORMAT = 2
#: The first release's format (0.1.0): no version recorded anywhere.
FIRST_FORMAT = 1

_MAGIC = b"AVST"
_HEADER = struct.Struct(">4sH")

SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (
    key TEXT PRIMARY KEY,
    value TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS pairs (
    id TEXT PRIMARY KEY,
    key_json TEXT NOT NULL,
    k INTEGER NOT NULL,
    rule TEXT NOT NULL,
    refit_interval INTEGER NOT NULL,
    updated REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS snapshots (
    pair_id TEXT PRIMARY KEY REFERENCES pairs(id),
    arrays BLOB NOT NULL,
    applied_json TEXT NOT NULL,
    version INTEGER NOT NULL,
    round INTEGER NOT NULL,
    updated REAL NOT NULL,
    format INTEGER NOT NULL DEFAULT 1,
    checksum TEXT NOT NULL DEFAULT '',
    last_outcome TEXT NOT NULL DEFAULT ''
);
CREATE TABLE IF NOT EXISTS coefficient_history (
    pair_id TEXT NOT NULL REFERENCES pairs(id),
    version INTEGER NOT NULL,
    round INTEGER NOT NULL,
    time REAL NOT NULL,
    slope REAL NOT NULL,
    intercepts_json TEXT NOT NULL,
    outcome TEXT NOT NULL,
    PRIMARY KEY (pair_id, round, version, outcome, time)
);
CREATE TABLE IF NOT EXISTS cost_curves (
    pair_id TEXT NOT NULL REFERENCES pairs(id),
    hardware TEXT NOT NULL,
    draft_json TEXT NOT NULL,
    verify_json TEXT NOT NULL,
    cudagraph_limit INTEGER NOT NULL,
    PRIMARY KEY (pair_id, hardware)
);
CREATE TABLE IF NOT EXISTS workers (
    pair_id TEXT NOT NULL REFERENCES pairs(id),
    worker_id TEXT NOT NULL,
    sequence INTEGER NOT NULL,
    seen REAL NOT NULL,
    PRIMARY KEY (pair_id, worker_id)
);
CREATE TABLE IF NOT EXISTS quarantine (
    pair_id TEXT NOT NULL,
    time REAL NOT NULL,
    reason TEXT NOT NULL,
    key_json TEXT,
    arrays BLOB,
    PRIMARY KEY (pair_id, time)
);
"""


class StoreTooNew(RuntimeError):
    """The store was written by a newer release: refused, nothing read."""


class CorruptSnapshot(ValueError):
    """A snapshot row that fails its checksum or cannot be decoded."""


# -- blobs -------------------------------------------------------------------------


def pack_arrays(arrays: dict[str, np.ndarray]) -> bytes:
    """A snapshot's arrays as a blob: the header, then a zlib-compressed ``.npz``.

    Compression (level 1) shrinks a K = 64 pair's snapshot from about 1 MB (its
    calibration histograms are mostly empty) to about 37 kB.
    """
    return _HEADER.pack(_MAGIC, BLOB_FORMAT) + zlib.compress(npz_bytes(arrays), 1)


_LOCAL = struct.Struct("<IHHHHHIIIHH")
_CENTRAL = struct.Struct("<IHHHHHHIIIHHHHHII")
_END = struct.Struct("<IHHHHIIH")
#: 1980-01-01 00:00 in MS-DOS date and time (every member; nothing reads it).
_DOS_TIME, _DOS_DATE = 0, (0 << 9) | (1 << 5) | 1


def npz_bytes(arrays: dict[str, np.ndarray]) -> bytes:
    """The ``.npz`` archive ``np.savez`` writes (members stored, ``.npy`` format 1.0).

    Written directly: ``np.savez`` goes through :mod:`zipfile` member by member,
    which took most of a snapshot's encoding time (a snapshot has about 45
    small arrays, and a busy pair is snapshotted at every group commit).
    ``np.load`` reads it like any ``.npz``.
    """
    parts: list[bytes] = []
    central: list[bytes] = []
    offset = 0
    for name, value in arrays.items():
        a = np.asanyarray(value)
        head = io.BytesIO()
        np.lib.format.write_array_header_1_0(head, np.lib.format.header_data_from_array_1_0(a))
        fortran = a.flags.f_contiguous and not a.flags.c_contiguous  # as the header says
        data = head.getvalue() + a.tobytes(order="F" if fortran else "C")
        fname = f"{name}.npy".encode()
        crc, size = zlib.crc32(data), len(data)
        parts += [
            _LOCAL.pack(0x04034B50, 20, 0, 0, _DOS_TIME, _DOS_DATE, crc, size, size, len(fname), 0),
            fname,
            data,
        ]
        central += [
            _CENTRAL.pack(
                0x02014B50, 20, 20, 0, 0, _DOS_TIME, _DOS_DATE, crc, size, size, len(fname),
                0, 0, 0, 0, 0, offset,
            ),
            fname,
        ]  # fmt: skip
        offset += _LOCAL.size + len(fname) + size
    directory = b"".join(central)
    n = len(arrays)
    end = _END.pack(0x06054B50, 0, 0, n, n, len(directory), offset, 0)
    return b"".join(parts) + directory + end


def blob_format(blob: bytes) -> int:
    """The format of a blob: its header's, or 1 for a bare ``.npz`` (0.1.0)."""
    if blob[:4] == _MAGIC and len(blob) >= _HEADER.size:
        return int(_HEADER.unpack_from(blob)[1])
    return FIRST_FORMAT


def unpack_arrays(blob: bytes) -> dict[str, np.ndarray]:
    """The arrays of a blob of any known format, migrated to :data:`BLOB_FORMAT`."""
    fmt = blob_format(blob)
    if fmt > BLOB_FORMAT:
        raise StoreTooNew(
            f"a snapshot has format {fmt}; avest {__version__} reads formats up to {BLOB_FORMAT}"
        )
    try:
        body = zlib.decompress(blob[_HEADER.size :]) if fmt > FIRST_FORMAT else blob
        with np.load(io.BytesIO(body), allow_pickle=False) as npz:
            arrays = {name: npz[name] for name in npz.files}
    except Exception as exc:
        raise CorruptSnapshot(f"snapshot blob unreadable: {exc}") from exc
    for step in range(fmt, BLOB_FORMAT):
        arrays = BLOB_MIGRATIONS[step](arrays)
    return arrays


#: ``from_format -> arrays -> arrays`` of the next format. 1 -> 2 changed only the
#: header and compression around the archive, not the arrays.
BLOB_MIGRATIONS: dict[int, Callable[[dict[str, np.ndarray]], dict[str, np.ndarray]]] = {
    1: lambda arrays: arrays,
}


def checksum(
    pair_id: str,
    key_json: str,
    rule: str,
    refit_interval: int,
    blob: bytes,
    last_outcome: str,
) -> str:
    """SHA-256 over everything a snapshot row restores (hex)."""
    h = hashlib.sha256()
    for part in (pair_id, key_json, rule, str(int(refit_interval)), last_outcome):
        data = part.encode()
        h.update(len(data).to_bytes(8, "big"))
        h.update(data)
    h.update(len(blob).to_bytes(8, "big"))
    h.update(blob)
    return h.hexdigest()


# -- the file ------------------------------------------------------------------------


def stored_format(db: sqlite3.Connection) -> int:
    """The file's format: 0 for a new (empty) file, 1 for 0.1.0's, else user_version."""
    version = int(db.execute("PRAGMA user_version").fetchone()[0])
    if version:
        return version
    tables = {r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type='table'")}
    return FIRST_FORMAT if "pairs" in tables else 0


#: Tables the first release (0.1.0) wrote; it left no version anywhere.
FIRST_TABLES = frozenset({"pairs", "snapshots", "coefficient_history", "cost_curves"})
#: Tables of :data:`SCHEMA`.
TABLES = frozenset(re.findall(r"CREATE TABLE IF NOT EXISTS (\w+)", SCHEMA))
#: Tables and columns every store avest wrote has, whatever its format.
SIGNATURE = {"pairs": {"id", "key_json", "rule"}, "snapshots": {"pair_id", "arrays"}}


def not_avest(db: sqlite3.Connection) -> str:
    """Why the file is not a store avest wrote, or "" (a store of any format, or a
    new file with no tables).

    Read before anything is written: a database of someone else's (its own tables,
    or its own ``user_version``) must never be taken for a store and migrated.
    """
    version = int(db.execute("PRAGMA user_version").fetchone()[0])
    tables = sorted(
        r[0]
        for r in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")
        if not str(r[0]).startswith("sqlite_")  # SQLite's own (sequences, statistics)
    )
    if not tables:
        if version:
            return f"has user_version {version} and no tables, which avest never writes"
        return ""
    if version > STORE_FORMAT and "meta" in tables and written_by(db) != UNKNOWN_RELEASE:
        return ""  # a newer release's store: refused as too new, with its release named
    foreign = [t for t in tables if t not in TABLES | FIRST_TABLES]
    if foreign:
        return f"holds tables that are not avest's: {', '.join(foreign)}"
    for table, columns in SIGNATURE.items():
        if table not in tables:
            return f"holds no {table} table (its tables: {', '.join(tables)})"
        missing = columns - _columns(db.cursor(), table)
        if missing:
            return f"has a {table} table without avest's columns {', '.join(sorted(missing))}"
    if version > STORE_FORMAT:
        return f"has user_version {version} but no record of the avest release that wrote it"
    return ""


#: What :func:`written_by` answers for a file that does not name its release.
UNKNOWN_RELEASE = "an unknown release"


def written_by(db: sqlite3.Connection) -> str:
    try:
        row = db.execute("SELECT value FROM meta WHERE key = 'written_by'").fetchone()
    except sqlite3.DatabaseError:
        return UNKNOWN_RELEASE
    return f"avest {row[0]}" if row else UNKNOWN_RELEASE


def _columns(cur: sqlite3.Cursor, table: str) -> set[str]:
    return {r[1] for r in cur.execute(f"PRAGMA table_info({table})")}


def _migrate_1_to_2(cur: sqlite3.Cursor) -> None:
    """0.1.0 -> format 2: blob header, checksums, last outcome, the workers table."""
    have = _columns(cur, "snapshots")
    for column, decl in (
        ("format", "INTEGER NOT NULL DEFAULT 1"),
        ("checksum", "TEXT NOT NULL DEFAULT ''"),
        ("last_outcome", "TEXT NOT NULL DEFAULT ''"),
    ):
        if column not in have:
            cur.execute(f"ALTER TABLE snapshots ADD COLUMN {column} {decl}")
    rows = cur.execute(
        "SELECT s.pair_id, s.arrays, s.applied_json, s.updated, p.key_json, p.rule, "
        "p.refit_interval FROM snapshots s JOIN pairs p ON p.id = s.pair_id"
    ).fetchall()
    for pid, blob, applied_json, updated, key_json, rule, interval in rows:
        # The first release kept the pair's last refit outcome only in memory; its
        # history has it (the newest refit row, unless a reset came after).
        last = cur.execute(
            "SELECT outcome FROM coefficient_history WHERE pair_id = ? "
            "ORDER BY time DESC, round DESC LIMIT 1",
            (pid,),
        ).fetchone()
        outcome = last[0] if last and last[0] in ("applied", "slope_held", "rejected") else ""
        try:
            arrays = unpack_arrays(bytes(blob))
            new_blob = pack_arrays(arrays)
        except CorruptSnapshot:
            new_blob = bytes(blob)  # left as found: the load quarantines it
        cur.execute(
            "UPDATE snapshots SET arrays = ?, applied_json = '{}', format = ?, checksum = ?, "
            "last_outcome = ? WHERE pair_id = ?",
            (
                new_blob,
                BLOB_FORMAT,
                checksum(pid, key_json, rule, interval, new_blob, outcome),
                outcome,
                pid,
            ),
        )
        try:
            applied = json.loads(applied_json)
        except ValueError:
            applied = {}
        cur.executemany(
            "INSERT OR REPLACE INTO workers (pair_id, worker_id, sequence, seen) VALUES (?,?,?,?)",
            [(pid, str(w), int(s), float(updated)) for w, s in applied.items()],
        )


#: ``from_format -> step`` run inside the migration transaction.
SCHEMA_MIGRATIONS: dict[int, Callable[[sqlite3.Cursor], None]] = {
    1: _migrate_1_to_2,
}


def migrate(db: sqlite3.Connection, found: int) -> None:
    """Create or migrate the file to :data:`STORE_FORMAT` in one transaction."""
    cur = db.cursor()
    begin(cur)
    try:
        for statement in SCHEMA.split(";\n"):
            if statement.strip():
                cur.execute(statement)
        for step in range(found or STORE_FORMAT, STORE_FORMAT):
            SCHEMA_MIGRATIONS[step](cur)
        set_meta(cur)
        cur.execute(f"PRAGMA user_version = {STORE_FORMAT}")
        cur.execute("COMMIT")
    except BaseException as exc:
        rollback(db, exc)
        raise


def rollback(db: sqlite3.Connection, failure: BaseException) -> None:
    """Undo the transaction ``failure`` interrupted; ``failure`` stays what is reported.

    After some errors (disk full, I/O errors) SQLite has already rolled the whole
    transaction back, and a ROLLBACK then fails with "cannot rollback - no
    transaction is active": raised, that would hide the cause. A ROLLBACK that
    fails for another reason is logged and noted on ``failure``, never raised in
    its place; the next transaction retries it (:func:`begin`).
    """
    if not db.in_transaction:
        return
    try:
        db.execute("ROLLBACK")
    except sqlite3.Error as exc:
        failure.add_note(f"the rollback failed too: {type(exc).__name__}: {exc}")
        log.warning("rollback after %s failed too: %s", failure, exc)


def begin(cur: sqlite3.Cursor) -> None:
    """Open a write transaction, first ending one a failed rollback left open."""
    if cur.connection.in_transaction:
        cur.execute("ROLLBACK")
    cur.execute("BEGIN IMMEDIATE")


def set_meta(cur: sqlite3.Cursor) -> None:
    cur.executemany(
        "INSERT OR REPLACE INTO meta (key, value) VALUES (?, ?)",
        [("format", str(STORE_FORMAT)), ("written_by", __version__)],
    )
