"""Embedded persistence: one SQLite file in the data directory.

Tables: ``pairs`` (key, rule, refit interval), ``snapshots`` (the
estimator's arrays — coefficients, open round statistics, calibration
state, the update rule's carried information — as one ``.npz`` blob, with
the per-worker sequence watermarks), ``coefficient_history`` (every
coefficient change: version, round, time, outcome) and ``cost_curves`` (per
pair and hardware label).

A :class:`Store` is used from one thread at a time (the service gives it a
thread of its own). Each :meth:`write` is one transaction, committed with
``synchronous=FULL`` before the batches it covers are acknowledged.
"""

from __future__ import annotations

import io
import json
import sqlite3
from pathlib import Path
from typing import Any

import numpy as np

SCHEMA = """
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
    updated REAL NOT NULL
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
"""

#: How many history rows a restored pair keeps in memory.
HISTORY_KEPT = 256


def pack_arrays(arrays: dict[str, np.ndarray]) -> bytes:
    buf = io.BytesIO()
    np.savez(buf, **arrays)
    return buf.getvalue()


def unpack_arrays(blob: bytes) -> dict[str, np.ndarray]:
    with np.load(io.BytesIO(blob), allow_pickle=False) as npz:
        return {name: npz[name] for name in npz.files}


class Store:
    def __init__(self, path: Path | str) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA synchronous=FULL")
        self.db.execute("PRAGMA foreign_keys=ON")
        self.db.executescript(SCHEMA)

    def close(self) -> None:
        self.db.close()

    def write(self, records: list[dict[str, Any]]) -> None:
        """Persist pair snapshots (from ``Registry.snapshot``) in one transaction."""
        if not records:
            return
        cur = self.db.cursor()
        cur.execute("BEGIN IMMEDIATE")
        try:
            for r in records:
                self._write_one(cur, r)
            cur.execute("COMMIT")
        except BaseException:
            cur.execute("ROLLBACK")
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
        cur.execute(
            "INSERT OR REPLACE INTO snapshots (pair_id, arrays, applied_json, version, round, updated) "
            "VALUES (?,?,?,?,?,?)",
            (
                r["id"],
                pack_arrays(r["arrays"]),
                json.dumps(r["applied"]),
                int(counters[0]),
                int(counters[1]),
                r["updated"],
            ),
        )
        cur.executemany(
            "INSERT OR IGNORE INTO coefficient_history VALUES (?,?,?,?,?,?,?)",
            [
                (
                    r["id"],
                    h["version"],
                    h["round"],
                    h["time"],
                    h["slope"],
                    json.dumps(list(h["intercepts"])),
                    h["outcome"],
                )
                for h in r["history"]
            ],
        )
        for c in r["costs"]:
            cur.execute(
                "INSERT OR REPLACE INTO cost_curves VALUES (?,?,?,?,?)",
                (
                    r["id"],
                    c["hardware"],
                    json.dumps(c["draft"]),
                    json.dumps(c["verify"]),
                    c["cudagraph_limit"],
                ),
            )

    def load(self) -> list[dict[str, Any]]:
        """Every pair's last snapshot, in the form ``Registry.restore`` takes."""
        out = []
        rows = self.db.execute(
            "SELECT p.id, p.key_json, p.rule, p.refit_interval, s.arrays, s.applied_json, s.updated "
            "FROM pairs p JOIN snapshots s ON s.pair_id = p.id ORDER BY p.id"
        ).fetchall()
        for pid, key_json, rule, interval, blob, applied_json, updated in rows:
            costs = [
                {
                    "hardware": hw,
                    "draft": json.loads(d),
                    "verify": json.loads(v),
                    "cudagraph_limit": lim,
                }
                for hw, d, v, lim in self.db.execute(
                    "SELECT hardware, draft_json, verify_json, cudagraph_limit FROM cost_curves WHERE pair_id = ?",
                    (pid,),
                )
            ]
            history = [
                {
                    "version": v,
                    "round": rd,
                    "time": t,
                    "slope": s,
                    "intercepts": json.loads(i),
                    "outcome": o,
                }
                for v, rd, t, s, i, o in reversed(
                    self.db.execute(
                        "SELECT version, round, time, slope, intercepts_json, outcome FROM coefficient_history "
                        "WHERE pair_id = ? ORDER BY time DESC, round DESC LIMIT ?",
                        (pid, HISTORY_KEPT),
                    ).fetchall()
                )
            ]
            out.append(
                {
                    "id": pid,
                    "key": json.loads(key_json),
                    "rule": rule,
                    "refit_interval": interval,
                    "arrays": unpack_arrays(blob),
                    "applied": json.loads(applied_json),
                    "costs": costs,
                    "history": history,
                    "updated": updated,
                }
            )
        return out

    def history(
        self, pair_id: str, limit: int = 1000
    ) -> list[tuple[int, int, float, float, list[float], str]]:
        rows = self.db.execute(
            "SELECT version, round, time, slope, intercepts_json, outcome FROM coefficient_history "
            "WHERE pair_id = ? ORDER BY time, round LIMIT ?",
            (pair_id, limit),
        ).fetchall()
        return [(v, r, t, s, json.loads(i), o) for v, r, t, s, i, o in rows]
