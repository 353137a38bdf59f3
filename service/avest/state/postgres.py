"""Pairs stored in a PostgreSQL database (``--store postgresql://...``).

The same records as the SQLite file (:mod:`avest.state.store`): the same
tables (``meta``, ``pairs``, ``snapshots``, ``workers``, ``coefficient_history``,
``cost_curves``, ``quarantine``), the same snapshot blobs with the same
checksums (:mod:`avest.state.store_format`), read back through the same checks.
The ``meta`` table holds the store format and the release that last wrote it;
a database of a newer format is refused before anything is read, and one that
holds tables of someone else's before anything is written.

Each :meth:`PostgresStore.write` is one transaction: an upsert per pair, its
``revision`` raised by one on every write (what a later writer can compare
before it overwrites), and the number of pairs held, kept in ``meta``. A write
the server refuses leaves nothing of it behind and raises
:class:`StoreWriteRefused` naming the pairs; a broken connection is opened
again on the next call.

What catches a lost store (:class:`MetaGuard`): the ``meta`` table's count of
the pairs held, written with every write and delete. A database whose count
says it held pairs and whose ``pairs`` table has none is refused at start
(unless ``--allow-empty-store``); a database with no avest tables at all is a
first start or the wrong database: a warning, or refused with
``--refuse-empty-store``. The state file of the data directory is not used:
the database is the one place that knows what it held.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import re
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg
from psycopg.conninfo import conninfo_to_dict

from avest import __version__
from avest.state.guard import StoreEmptied
from avest.state.store import (
    COST_ROWS,
    HISTORY_KEPT,
    NEWEST_HISTORY,
    PAIR_ROW,
    WORKER_ROWS,
    Loaded,
    NotAStore,
    StoreTooNew,
    StoreUnreadable,
    cost_rows,
    history_rows,
    pair_record,
)
from avest.state.store_format import (
    BLOB_FORMAT,
    SIGNATURE,
    STORE_FORMAT,
    CorruptSnapshot,
    checksum,
    pack_arrays,
)
from avest.state.store_format import SCHEMA as SQLITE_SCHEMA

log = logging.getLogger("avest")

#: Seconds to wait for the server when connecting: a start or a retried write
#: reports an unreachable server instead of hanging on it.
CONNECT_TIMEOUT_S = 10
#: TCP keepalives (libpq's, unless the URL sets them): a server or network that
#: vanishes without closing the connection is noticed within about 25 s, instead
#: of the system's two hours, so a replica stops believing it refits its pairs.
#: The server's side (its ``tcp_keepalives_*`` settings) frees a vanished
#: replica's locks; the deploy manifests set it.
KEEPALIVES = {
    "keepalives": "1",
    "keepalives_idle": "10",
    "keepalives_interval": "5",
    "keepalives_count": "3",
    "tcp_user_timeout": "25000",
    # The server's side, for this session: a replica whose node vanished has its
    # session, and the locks it holds, ended as soon (whatever the server's defaults).
    "options": "-c tcp_keepalives_idle=10 -c tcp_keepalives_interval=5 "
    "-c tcp_keepalives_count=3 -c tcp_user_timeout=25000",
}


def _postgres_layout(sqlite_schema: str) -> str:
    """The layout in PostgreSQL: SQLite's (``store_format.SCHEMA``, format 2,
    the first PostgreSQL holds) in PostgreSQL's types (SQLite's INTEGER is 64-bit,
    so BIGINT), with ``pairs.revision`` added (raised by every write of the pair)
    and ``snapshots.applied_json`` (format 1's, read by migrations only) left out."""
    ddl = sqlite_schema.replace("    applied_json TEXT NOT NULL,\n", "")
    ddl = ddl.replace(
        "    updated REAL NOT NULL\n);\nCREATE TABLE IF NOT EXISTS snapshots",
        "    updated REAL NOT NULL,\n    revision INTEGER NOT NULL DEFAULT 1\n);\n"
        "CREATE TABLE IF NOT EXISTS snapshots",
    )
    for sqlite_type, postgres_type in (
        ("INTEGER", "BIGINT"),
        ("REAL", "DOUBLE PRECISION"),
        ("BLOB", "BYTEA"),
    ):
        ddl = re.sub(rf"\b{sqlite_type}\b", postgres_type, ddl)
    if "applied_json" in ddl or "revision" not in ddl:  # SQLite's layout moved: say so
        raise RuntimeError("the PostgreSQL layout no longer follows SQLite's; update it")
    return ddl


#: What replicas share beside the pairs (:mod:`avest.state.replicas`): the log of
#: what workers sent and the refitter has not folded yet (``pending``: one row per
#: round summary, raw step or command, unique per worker and sequence, so a resend
#: is stored once), and the replicas alive (``replicas``: each one's last heartbeat).
REPLICA_SCHEMA = """
CREATE TABLE IF NOT EXISTS pending (
    id BIGSERIAL PRIMARY KEY,
    pair_id TEXT NOT NULL,
    worker_id TEXT NOT NULL,
    sequence BIGINT NOT NULL,
    kind TEXT NOT NULL,
    payload BYTEA NOT NULL,
    replica TEXT NOT NULL,
    received DOUBLE PRECISION NOT NULL,
    UNIQUE (pair_id, worker_id, sequence)
);
CREATE INDEX IF NOT EXISTS pending_pair ON pending (pair_id, id);
-- Payloads are protobuf float arrays (round summaries, raw steps) that do not
-- compress: stored out of line as they are, without PostgreSQL's compression try.
ALTER TABLE pending ALTER COLUMN payload SET STORAGE EXTERNAL;
CREATE TABLE IF NOT EXISTS replicas (
    name TEXT PRIMARY KEY,
    started DOUBLE PRECISION NOT NULL,
    seen DOUBLE PRECISION NOT NULL,
    session BIGINT NOT NULL DEFAULT 0
);
"""
SCHEMA = _postgres_layout(SQLITE_SCHEMA) + REPLICA_SCHEMA
#: The tables of :data:`SCHEMA`.
TABLES = frozenset(
    line.split()[5] for line in SCHEMA.splitlines() if line.startswith("CREATE TABLE")
)
#: Tables whose rows belong to one pair, removed with it (``pairs`` last).
PAIR_TABLES = ("workers", "coefficient_history", "cost_curves", "snapshots", "pending")


class StoreWriteRefused(RuntimeError):
    """PostgreSQL refused a write or a delete: nothing of it was written."""


class StaleWrite(RuntimeError):
    """A refit built on a revision of the pair the store no longer holds: not written."""


def redacted(url: str) -> str:
    """The URL without its password, for messages and logs."""
    try:
        parts = conninfo_to_dict(url)
    except psycopg.ProgrammingError:
        return "postgresql://(unparsable URL)"
    user = f"{parts['user']}@" if parts.get("user") else ""
    host = str(parts.get("host", ""))
    port = f":{parts['port']}" if parts.get("port") else ""
    return f"postgresql://{user}{host}{port}/{parts.get('dbname', '')}"


class PostgresStore:
    """A PostgreSQL database: one implementation of :class:`~avest.state.store.PairStore`."""

    #: Several processes may share it: each is a replica (:mod:`avest.state.replicas`).
    replicated = True

    def __init__(self, url: str) -> None:
        self.url = url
        self.location = redacted(url)
        self.backup: Path | None = None
        self.conn = self._connect()
        try:
            found, recorded = self._open()
        except BaseException:
            self.conn.close()
            raise
        #: The format found on opening (0: a database with no avest tables).
        self.found_format = found
        #: The pairs the database recorded holding before this start.
        self.recorded_pairs = recorded

    def _connect(self) -> psycopg.Connection[Any]:
        given = conninfo_to_dict(self.url)
        options: dict[str, Any] = {k: v for k, v in KEEPALIVES.items() if k not in given}
        try:
            return psycopg.connect(
                self.url, autocommit=True, connect_timeout=CONNECT_TIMEOUT_S, **options
            )
        except psycopg.Error as exc:
            raise StoreUnreadable(f"{self.location}: cannot connect: {exc}") from exc

    def _connection(self) -> psycopg.Connection[Any]:
        """The connection, opened again if the last one broke (a server restart)."""
        if self.conn.closed or self.conn.broken:
            self.conn.close()
            self.conn = self._connect()
        return self.conn

    def _open(self) -> tuple[int, int]:
        """Check what the database holds, then create the tables of a new one (one
        transaction); a database already at :data:`STORE_FORMAT` is not written to."""
        try:
            with self.conn.transaction(), self.conn.cursor() as cur:
                # Replicas starting together on a new database: one creates the
                # tables, the others wait and find them (concurrent CREATE TABLE IF
                # NOT EXISTS collide in PostgreSQL's catalog).
                cur.execute("SELECT pg_advisory_xact_lock(%s, 0)", (LOCK_SPACE,))
                columns = _columns(cur)
                foreign = sorted(set(columns) - TABLES)
                if foreign:
                    raise NotAStore(
                        f"{self.location} holds tables that are not avest's: "
                        f"{', '.join(foreign)}; refusing to write into it (nothing was "
                        "changed). Give avest a database of its own."
                    )
                meta = _meta(cur) if "meta" in columns else {}
                if columns and "format" not in meta:
                    raise NotAStore(
                        f"{self.location} holds tables ({', '.join(sorted(columns))}) but no "
                        "record of an avest store format; refusing to write into it "
                        "(nothing was changed)."
                    )
                for table, wanted in SIGNATURE.items():
                    missing = wanted - columns.get(table, wanted)
                    if table in columns and missing:
                        raise NotAStore(
                            f"{self.location} has a {table} table without avest's columns "
                            f"{', '.join(sorted(missing))}; nothing was changed."
                        )
                found = int(meta.get("format", 0))
                if found > STORE_FORMAT:
                    raise StoreTooNew(
                        f"{self.location} has store format {found}, written by avest "
                        f"{meta.get('written_by', '(unknown)')}; avest {__version__} reads "
                        f"formats up to {STORE_FORMAT}. Nothing was read or changed: run the "
                        "release that wrote it (or a newer one)."
                    )
                if 0 < found < STORE_FORMAT:
                    # No release wrote an older format here; a later format adds its
                    # migration step from this one (as store_format's for SQLite).
                    raise StoreUnreadable(
                        f"{self.location} has store format {found}, which no avest release "
                        "wrote in PostgreSQL; nothing was changed."
                    )
                if found == STORE_FORMAT and not {"pending", "replicas"} <= set(columns):
                    cur.execute(REPLICA_SCHEMA)  # a store written before replicas
                if found != STORE_FORMAT:  # a new database
                    cur.execute(SCHEMA)
                    cur.executemany(
                        "INSERT INTO meta (key, value) VALUES (%s, %s) "
                        "ON CONFLICT (key) DO UPDATE SET value = excluded.value",
                        [("format", str(STORE_FORMAT)), ("written_by", __version__)],
                    )
                return found, int(meta.get("pairs", 0))
        except psycopg.Error as exc:
            raise StoreUnreadable(f"{self.location}: {exc}") from exc

    def close(self) -> None:
        self.conn.close()

    def guard(self, data_dir: Path | str) -> MetaGuard:
        """The count in ``meta`` (the data directory plays no part)."""
        return MetaGuard(self)

    # -- writing -------------------------------------------------------------------

    def write(self, records: list[dict[str, Any]]) -> None:
        """Persist pair snapshots (from ``Registry.snapshot``) in one transaction."""
        if not records:
            return
        try:
            conn = self._connection()
            with conn.transaction(), conn.cursor() as cur:
                for r in records:
                    self._write_one(cur, r)
                held = _count_pairs(cur)
            self.recorded_pairs = held
        except psycopg.Error as exc:
            ids = ", ".join(r["id"] for r in records)
            raise StoreWriteRefused(
                f"{self.location} refused the write of {len(records)} pair(s) ({ids}); "
                f"nothing of it was written: {type(exc).__name__}: {exc}"
            ) from exc

    def _write_one(self, cur: psycopg.Cursor[Any], r: dict[str, Any]) -> int:
        """Upsert one pair's rows; its revision after the write."""
        pid = r["id"]
        key_json = json.dumps(r["key"], sort_keys=True)
        written = cur.execute(
            "INSERT INTO pairs (id, key_json, k, rule, refit_interval, updated) "
            "VALUES (%s, %s, %s, %s, %s, %s) ON CONFLICT (id) DO UPDATE SET "
            "rule = excluded.rule, refit_interval = excluded.refit_interval, "
            "updated = excluded.updated, revision = pairs.revision + 1 RETURNING revision",
            (pid, key_json, r["key"]["k"], r["rule"], r["refit_interval"], r["updated"]),
        ).fetchone()
        revision = int(written[0]) if written else 0
        counters = r["arrays"]["counters"]
        blob = pack_arrays(r["arrays"])
        outcome = r.get("last_outcome", "")
        cur.execute(
            "INSERT INTO snapshots (pair_id, arrays, version, round, updated, format, checksum, "
            "last_outcome) VALUES (%s, %s, %s, %s, %s, %s, %s, %s) ON CONFLICT (pair_id) DO "
            "UPDATE SET arrays = excluded.arrays, version = excluded.version, "
            "round = excluded.round, updated = excluded.updated, format = excluded.format, "
            "checksum = excluded.checksum, last_outcome = excluded.last_outcome",
            (
                pid,
                blob,
                int(counters[0]),
                int(counters[1]),
                r["updated"],
                BLOB_FORMAT,
                checksum(pid, key_json, r["rule"], r["refit_interval"], blob, outcome),
                outcome,
            ),
        )
        workers = [(pid, w, int(seq), float(seen)) for w, (seq, seen) in r["workers"].items()]
        if workers:
            cur.executemany(
                "INSERT INTO workers (pair_id, worker_id, sequence, seen) VALUES (%s, %s, %s, %s) "
                "ON CONFLICT (pair_id, worker_id) DO UPDATE SET sequence = excluded.sequence, "
                "seen = excluded.seen",
                workers,
            )
        pruned = list(r.get("pruned", ()))
        if pruned:
            cur.execute(
                "DELETE FROM workers WHERE pair_id = %s AND worker_id = ANY(%s)", (pid, pruned)
            )
        history = history_rows(r)
        if history:
            cur.executemany(
                "INSERT INTO coefficient_history VALUES (%s, %s, %s, %s, %s, %s, %s) "
                "ON CONFLICT DO NOTHING",
                history,
            )
        if r.get("history_cleared"):
            cur.execute(
                "DELETE FROM coefficient_history WHERE pair_id = %s AND time < %s",
                (pid, r["history_cleared"]),
            )
        costs = cost_rows(r)
        if costs:
            cur.executemany(
                "INSERT INTO cost_curves VALUES (%s, %s, %s, %s, %s) ON CONFLICT (pair_id, "
                "hardware) DO UPDATE SET draft_json = excluded.draft_json, "
                "verify_json = excluded.verify_json, cudagraph_limit = excluded.cudagraph_limit",
                costs,
            )
        return revision

    def delete(self, pair_id: str) -> None:
        """Remove every row of a pair (one transaction)."""
        try:
            conn = self._connection()
            with conn.transaction(), conn.cursor() as cur:
                _delete(cur, pair_id)
                held = _count_pairs(cur)
            self.recorded_pairs = held
        except psycopg.Error as exc:
            raise StoreWriteRefused(
                f"{self.location} refused to delete pair {pair_id} (nothing was deleted): "
                f"{type(exc).__name__}: {exc}"
            ) from exc

    def quarantine(self, pair_id: str, reason: str) -> bool:
        """Keep a pair's unreadable state aside and free its id; False if that failed."""
        try:
            conn = self._connection()
            with conn.transaction(), conn.cursor() as cur:
                cur.execute(
                    "INSERT INTO quarantine (pair_id, time, reason, key_json, arrays) "
                    "SELECT %s, %s, %s, p.key_json, s.arrays FROM (SELECT 1) one "
                    "LEFT JOIN pairs p ON p.id = %s LEFT JOIN snapshots s ON s.pair_id = %s",
                    (pair_id, time.time(), reason, pair_id, pair_id),
                )
                _delete(cur, pair_id)
                held = _count_pairs(cur)
            self.recorded_pairs = held
        except (psycopg.Error, StoreUnreadable):
            return False
        return True

    def rebuild(self, records: list[dict[str, Any]], quarantined: dict[str, str]) -> Path:
        """Not for a database: rows the server cannot even delete are for its operator."""
        raise StoreUnreadable(
            f"{self.location}: the rows of pair(s) {', '.join(quarantined)} cannot be read "
            "or set aside; repair the database (or restore a backup) and start again"
        )

    # -- reading ---------------------------------------------------------------------

    def load(self) -> Loaded:
        """Every pair's last snapshot, in the form ``Registry.restore`` takes.

        A pair whose rows fail their checksum or do not decode is reported in
        :attr:`Loaded.quarantined` instead; the others load.
        """
        out = Loaded()
        try:
            conn = self._connection()
            # One transaction: every pair as of one moment, even with another writer.
            with conn.transaction(), conn.cursor() as cur:
                cur.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
                ids = [str(r[0]) for r in cur.execute("SELECT id FROM pairs ORDER BY id")]
                for pid in ids:
                    try:
                        record = self._load_one(cur, pid)
                    except (CorruptSnapshot, ValueError, KeyError) as exc:
                        out.quarantined[pid] = f"{type(exc).__name__}: {exc}"
                        continue
                    if record is not None:
                        out.records.append(record)
        except psycopg.Error as exc:
            raise StoreUnreadable(f"{self.location}: cannot read the pairs: {exc}") from exc
        return out

    def _load_one(self, cur: psycopg.Cursor[Any], pid: str) -> dict[str, Any] | None:
        row = cur.execute(PAIR_ROW.format("%s"), (pid,)).fetchone()
        if row is None:
            return None
        return pair_record(
            self.location,
            pid,
            row,
            cur.execute(WORKER_ROWS.format("%s"), (pid,)).fetchall(),
            cur.execute(COST_ROWS.format("%s"), (pid,)).fetchall(),
            cur.execute(NEWEST_HISTORY.format("%s"), (pid, HISTORY_KEPT)).fetchall(),
        )

    def history(
        self, pair_id: str, limit: int = 1000
    ) -> list[tuple[int, int, float, float, list[float], str]]:
        """The pair's coefficient history, oldest first (at most ``limit`` rows)."""
        with self._connection().cursor() as cur:
            rows = cur.execute(
                "SELECT version, round, time, slope, intercepts_json, outcome FROM "
                "coefficient_history WHERE pair_id = %s ORDER BY time, round LIMIT %s",
                (pair_id, limit),
            ).fetchall()
        return [(v, r, t, s, json.loads(i), o) for v, r, t, s, i, o in rows]

    def record_pairs(self) -> None:
        """Record in ``meta`` how many pairs the database holds now."""
        try:
            conn = self._connection()
            with conn.transaction(), conn.cursor() as cur:
                self.recorded_pairs = _count_pairs(cur)
        except psycopg.Error as exc:
            raise StoreWriteRefused(
                f"{self.location}: cannot record the pairs held: {exc}"
            ) from exc

    def revision(self, pair_id: str) -> int:
        """How many times the pair's rows were written (0: not stored)."""
        with self._connection().cursor() as cur:
            row = cur.execute("SELECT revision FROM pairs WHERE id = %s", (pair_id,)).fetchone()
        return int(row[0]) if row else 0

    def format(self) -> tuple[int, str]:
        """The store format and the release recorded in ``meta``."""
        with self._connection().cursor() as cur:
            meta = _meta(cur)
        return int(meta["format"]), meta["written_by"]

    # -- replicas (:mod:`avest.state.replicas`) ------------------------------------

    def append_pending(self, rows: list[tuple[str, str, int, str, bytes]], replica: str) -> None:
        """Append ``(pair, worker, sequence, kind, payload)`` rows to the pending log in
        one transaction (a row already there, a resend, is kept once), then tell the
        replicas which pairs have something to fold."""
        if not rows:
            return
        now = time.time()
        try:
            conn = self._connection()
            with conn.transaction(), conn.cursor() as cur:
                # Rows of a pair deleted meanwhile are not kept: nothing would fold
                # them, and a pair registered again under the same key starts afresh.
                cur.executemany(
                    "INSERT INTO pending (pair_id, worker_id, sequence, kind, payload, replica, "
                    "received) SELECT %s, %s, %s, %s, %s, %s, %s WHERE EXISTS "
                    "(SELECT 1 FROM pairs WHERE id = %s) ON CONFLICT DO NOTHING",
                    [(*row, replica, now, row[0]) for row in rows],
                )
                for pid in sorted({row[0] for row in rows}):
                    cur.execute("SELECT pg_notify(%s, %s)", (PENDING_CHANNEL, pid))
        except psycopg.Error as exc:
            raise StoreWriteRefused(
                f"{self.location} refused {len(rows)} pending row(s); nothing of them was "
                f"written: {type(exc).__name__}: {exc}"
            ) from exc

    def create(self, records: list[dict[str, Any]]) -> dict[str, int]:
        """Store new pairs that no replica stored yet (one transaction); returns the ids
        this call created, with their revisions (a pair another replica created first
        is left as it is)."""
        created: dict[str, int] = {}
        try:
            conn = self._connection()
            with conn.transaction(), conn.cursor() as cur:
                for r in records:
                    row = cur.execute(
                        "INSERT INTO pairs (id, key_json, k, rule, refit_interval, updated) "
                        "VALUES (%s, %s, %s, %s, %s, %s) ON CONFLICT (id) DO NOTHING RETURNING id",
                        (
                            r["id"],
                            json.dumps(r["key"], sort_keys=True),
                            r["key"]["k"],
                            r["rule"],
                            r["refit_interval"],
                            r["updated"],
                        ),
                    ).fetchone()
                    if row is not None:
                        created[r["id"]] = self._write_one(cur, r)
                        cur.execute("SELECT pg_notify(%s, %s)", (PAIRS_CHANNEL, f"{r['id']} -1"))
                self.recorded_pairs = _count_pairs(cur)
        except psycopg.Error as exc:
            raise StoreWriteRefused(
                f"{self.location} refused to store {len(records)} new pair(s): {exc}"
            ) from exc
        return created

    def revisions(self) -> dict[str, tuple[int, int]]:
        """Every stored pair's revision (raised by each write of it) and coefficients
        version."""
        with self._connection().cursor() as cur:
            rows = cur.execute(
                "SELECT p.id, p.revision, coalesce(s.version, -1) FROM pairs p "
                "LEFT JOIN snapshots s ON s.pair_id = p.id"
            )
            return {str(i): (int(r), int(v)) for i, r, v in rows}

    def load_pair(self, pair_id: str) -> tuple[dict[str, Any] | None, int]:
        """One pair's record as :meth:`load` gives it (None: not stored), and its revision."""
        try:
            conn = self._connection()
            with conn.transaction(), conn.cursor() as cur:
                cur.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
                row = cur.execute("SELECT revision FROM pairs WHERE id = %s", (pair_id,))
                found = row.fetchone()
                if found is None:
                    return None, 0
                return self._load_one(cur, pair_id), int(found[0])
        except psycopg.Error as exc:
            raise StoreUnreadable(f"{self.location}: cannot read pair {pair_id}: {exc}") from exc

    def watermark(self, pair_id: str, worker: str) -> int:
        """The highest sequence stored of a worker: folded (``workers``) or pending."""
        with self._connection().cursor() as cur:
            row = cur.execute(
                "SELECT GREATEST((SELECT sequence FROM workers WHERE pair_id = %s AND "
                "worker_id = %s), (SELECT max(sequence) FROM pending WHERE pair_id = %s AND "
                "worker_id = %s))",
                (pair_id, worker, pair_id, worker),
            ).fetchone()
        return int(row[0]) if row and row[0] is not None else 0


#: NOTIFY channels: a pair written (payload: its id and coefficients version, -1 for
#: a new pair; "-id" once deleted), and pending rows appended for a pair (its id).
PAIRS_CHANNEL = "avest_pairs"
PENDING_CHANNEL = "avest_pending"
#: The first key of every advisory lock avest takes (the second is the pair's), so
#: that another application's advisory locks on the same database never collide.
LOCK_SPACE = 0x61766573  # "aves"


def lock_key(pair_id: str) -> int:
    """The pair's advisory lock key (32 bits of its id's hash; a collision only
    makes one replica refit both pairs)."""
    return int.from_bytes(hashlib.sha256(pair_id.encode()).digest()[:4], "big", signed=True)


class Leadership:
    """One replica's session for refitting: the advisory locks it holds (one per pair
    it refits; PostgreSQL releases them when the session ends, so a replica that
    dies hands its pairs over) and the transactions that fold the pending log.

    Used from one thread. A broken connection means every lock is gone:
    :meth:`alive` says so, and :meth:`connect` starts a new session holding none.
    """

    def __init__(self, store: PostgresStore, replica: str) -> None:
        self.store = store
        self.replica = replica
        self.conn: psycopg.Connection[Any] | None = None

    def alive(self) -> bool:
        return self.conn is not None and not (self.conn.closed or self.conn.broken)

    def connect(self) -> None:
        """A new session; the previous one of this replica, if PostgreSQL still keeps it
        (a connection that broke on this side only), is ended so its locks go."""
        if self.conn is not None:
            self.conn.close()
        self.conn = None
        self.conn = self.store._connect()
        with contextlib.suppress(psycopg.Error), self.conn.cursor() as cur:
            cur.execute(
                "SELECT pg_terminate_backend(session) FROM replicas WHERE name = %s "
                "AND session <> 0 AND session <> pg_backend_pid()",
                (self.replica,),
            )

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()

    def _cur(self) -> psycopg.Cursor[Any]:
        if not self.alive():
            raise StoreUnreadable(f"{self.store.location}: the refitting session is gone")
        assert self.conn is not None
        return self.conn.cursor()

    def heartbeat(self, started: float, live_s: float) -> int:
        """Record this replica as alive; returns how many replicas are."""
        now = time.time()
        with self._cur() as cur:
            cur.execute(
                "INSERT INTO replicas (name, started, seen, session) "
                "VALUES (%s, %s, %s, pg_backend_pid()) ON CONFLICT (name) DO UPDATE SET "
                "seen = excluded.seen, started = excluded.started, session = excluded.session",
                (self.replica, started, now),
            )
            cur.execute("DELETE FROM replicas WHERE seen < %s", (now - 10 * live_s,))
            # Alive: a recent heartbeat, and its session still open (a replica that
            # died is not counted from the moment PostgreSQL ended its session).
            row = cur.execute(
                "SELECT count(*) FROM replicas r WHERE r.seen >= %s AND EXISTS "
                "(SELECT 1 FROM pg_stat_activity a WHERE a.pid = r.session)",
                (now - live_s,),
            ).fetchone()
        return max(1, int(row[0]) if row else 1)

    def leave(self) -> None:
        with self._cur() as cur:
            cur.execute("DELETE FROM replicas WHERE name = %s", (self.replica,))

    def refitters(self) -> dict[int, str]:
        """Which replica holds each pair lock: ``lock key -> replica name``."""
        with self._cur() as cur:
            rows = cur.execute(
                "SELECT l.objid, r.name FROM pg_locks l JOIN replicas r ON r.session = l.pid "
                "WHERE l.locktype = 'advisory' AND l.granted AND l.classid = %s "
                "AND l.objsubid = 2",
                (LOCK_SPACE,),
            ).fetchall()
        # objid is an unsigned oid; the key was taken signed.
        return {
            int.from_bytes(int(o).to_bytes(4, "big"), "big", signed=True): str(n) for o, n in rows
        }

    def try_lock(self, pair_id: str) -> bool:
        with self._cur() as cur:
            row = cur.execute(
                "SELECT pg_try_advisory_lock(%s, %s)", (LOCK_SPACE, lock_key(pair_id))
            ).fetchone()
        return bool(row and row[0])

    def unlock(self, pair_id: str) -> None:
        self.unlock_key(lock_key(pair_id))

    def unlock_key(self, key: int) -> None:
        with self._cur() as cur:
            cur.execute("SELECT pg_advisory_unlock(%s, %s)", (LOCK_SPACE, key))

    def pending(self, pair_id: str, limit: int) -> list[tuple[int, str, int, str, bytes]]:
        """The pair's oldest pending rows: ``(id, worker, sequence, kind, payload)``."""
        with self._cur() as cur:
            rows = cur.execute(
                "SELECT id, worker_id, sequence, kind, payload FROM pending WHERE pair_id = %s "
                "ORDER BY id LIMIT %s",
                (pair_id, limit),
            ).fetchall()
        return [(int(i), str(w), int(q), str(k), bytes(p)) for i, w, q, k, p in rows]

    def commit(self, record: dict[str, Any], folded: list[int], revision: int) -> int:
        """Write the pair's snapshot and delete the pending rows it folded, in one
        transaction, then tell the replicas; the pair's new revision, or 0 (nothing
        written) when the pair is no longer stored (deleted meanwhile).

        ``revision``: the one the snapshot was built on. Another is in the store
        (a write this replica's memory has not seen) and nothing is written:
        :class:`StaleWrite`."""
        pid = record["id"]
        try:
            with self._cur() as cur, cur.connection.transaction():
                held = cur.execute(
                    "SELECT revision FROM pairs WHERE id = %s FOR UPDATE", (pid,)
                ).fetchone()
                if held is None:
                    return 0
                if int(held[0]) != revision:
                    raise StaleWrite(
                        f"pair {pid} is at revision {held[0]} in the store, this replica's "
                        f"copy at {revision}: not written, read again"
                    )
                revision = self.store._write_one(cur, record)
                if folded:
                    cur.execute("DELETE FROM pending WHERE id = ANY(%s)", (folded,))
                version = int(record["arrays"]["counters"][0])
                cur.execute("SELECT pg_notify(%s, %s)", (PAIRS_CHANNEL, f"{pid} {version}"))
        except psycopg.Error as exc:
            raise StoreWriteRefused(
                f"{self.store.location} refused the refit of pair {pid}; nothing of it was "
                f"written: {type(exc).__name__}: {exc}"
            ) from exc
        return revision


def listen(
    store: PostgresStore, deliver: Callable[[str, str], None], stop: threading.Event
) -> None:
    """Deliver ``(channel, payload)`` of every notification on avest's channels until
    ``stop`` is set (run on a thread of its own); a lost connection is opened again,
    and ``deliver("", "")`` says notifications may have been missed meanwhile."""
    while not stop.is_set():
        try:
            conn = store._connect()
        except StoreUnreadable:
            stop.wait(LISTEN_RETRY_S)
            continue
        try:
            with conn:
                conn.execute(f"LISTEN {PAIRS_CHANNEL}")
                conn.execute(f"LISTEN {PENDING_CHANNEL}")
                deliver("", "")
                while not stop.is_set():
                    for note in conn.notifies(timeout=LISTEN_POLL_S):
                        deliver(note.channel, note.payload)
        except psycopg.Error:
            stop.wait(LISTEN_RETRY_S)


#: How often the listener looks at its stop flag, and waits before connecting again.
LISTEN_POLL_S = 0.5
LISTEN_RETRY_S = 1.0


class MetaGuard:
    """What catches a lost PostgreSQL store: the count of pairs held, in ``meta``."""

    def __init__(self, store: PostgresStore) -> None:
        self.store = store

    def check_loaded(self, loaded_pairs: int, allow_empty: bool) -> None:
        held = self.store.recorded_pairs
        if held and loaded_pairs == 0 and not allow_empty:
            raise StoreEmptied(
                f"{self.store.location} holds no pairs, but its meta table records {held} "
                "pair(s) stored: its rows may have been removed. Refusing to start with every "
                "pair gone. Restore the database, or start with --allow-empty-store "
                "(AVEST_ALLOW_EMPTY_STORE=true) to begin afresh."
            )

    def check_unrecorded(self, loaded_pairs: int, refuse: bool, allow_empty: bool) -> None:
        if loaded_pairs or self.store.found_format:
            return
        what = (
            f"{self.store.location} held no avest tables: either this is the first start on "
            "this database, or the URL names another database than the one that holds the "
            "pairs."
        )
        if refuse and not allow_empty:
            raise StoreEmptied(
                f"{what} Refusing to start with no pairs (--refuse-empty-store, "
                "AVEST_REFUSE_EMPTY_STORE). Check --store; to begin afresh on purpose, start "
                "once with --allow-empty-store."
            )
        log.warning("%s Starting with no pairs.", what)

    def record(self, pairs: int) -> None:
        """Every write and delete records the count in its own transaction; what is
        left is a start that begins afresh on purpose (``--allow-empty-store``): it
        records that the database holds none."""
        if pairs == 0 and self.store.recorded_pairs:
            self.store.record_pairs()


def _columns(cur: psycopg.Cursor[Any]) -> dict[str, set[str]]:
    """The tables of the connection's schema and their columns."""
    out: dict[str, set[str]] = {}
    for table, column in cur.execute(
        "SELECT table_name, column_name FROM information_schema.columns "
        "WHERE table_schema = current_schema()"
    ).fetchall():
        out.setdefault(str(table), set()).add(str(column))
    return out


def _meta(cur: psycopg.Cursor[Any]) -> dict[str, str]:
    return {str(k): str(v) for k, v in cur.execute("SELECT key, value FROM meta").fetchall()}


def _delete(cur: psycopg.Cursor[Any], pair_id: str) -> None:
    # The pair's row first, as a refit's commit takes it: the two never deadlock.
    cur.execute("SELECT 1 FROM pairs WHERE id = %s FOR UPDATE", (pair_id,))
    for table in PAIR_TABLES:
        cur.execute(f"DELETE FROM {table} WHERE pair_id = %s", (pair_id,))
    cur.execute("DELETE FROM pairs WHERE id = %s", (pair_id,))
    cur.execute("SELECT pg_notify(%s, %s)", (PAIRS_CHANNEL, "-" + pair_id))


def _count_pairs(cur: psycopg.Cursor[Any]) -> int:
    """Record in ``meta`` how many pairs the database holds (for :class:`MetaGuard`)."""
    row = cur.execute(
        "INSERT INTO meta (key, value) SELECT 'pairs', count(*)::text FROM pairs "
        "ON CONFLICT (key) DO UPDATE SET value = excluded.value RETURNING value"
    ).fetchone()
    return int(row[0]) if row else 0
