"""A store written by the first release (0.1.0) opens under this one with identical pairs;
a store from a newer release is refused before anything is read.

The old store is written by 0.1.0's own ``avest serve`` (installed from commit
1cba659 into a venv of its own) while steps stream into it over gRPC; the current
code then opens the same data directory in-process.
"""

from __future__ import annotations

import hashlib
import sqlite3
from pathlib import Path

import httpx
import numpy as np
import pytest

from avest.offline.replay import pair_key
from avest.state.store import Store, StoreTooNew
from avest.state.store_format import BLOB_FORMAT, STORE_FORMAT
from avest_wire.v1 import estimator_pb2 as pb
from tests.support.rpc import messages_for, stub_for
from tests.support.server import launch

from .oldrelease import OldServer

pytestmark = pytest.mark.slow

#: Fields of GET /v1/pairs that must survive the upgrade unchanged.
SAME = (
    "id",
    "key",
    "K",
    "rule",
    "refit_interval",
    "coefficients",
    "version",
    "round",
    "observed_drafts",
    "observed_steps",
    "steps_in_round",
    "last_outcome",
    "updated",
    "cost_curve_hardware",
    "calibration",
    "recent_calibration",
)


def _same(new: object, old: object) -> bool:
    """Equal, floats to float32 storage: the AUC histograms are kept in float32, so
    the recent (decayed, fractional) counts of a 0.1.0 store round at the 7th digit."""
    if isinstance(old, float) and isinstance(new, float):
        return new == pytest.approx(old, rel=1e-6, abs=1e-9, nan_ok=True)
    if isinstance(old, dict) and isinstance(new, dict):
        return old.keys() == new.keys() and all(_same(new[k], old[k]) for k in old)
    if isinstance(old, list) and isinstance(new, list):
        return len(old) == len(new) and all(_same(a, b) for a, b in zip(new, old, strict=True))
    return new == old


def _write_with_old_release(data_dir: Path, trace_slice) -> tuple[dict, dict, str]:
    """Three pairs (both rules, labels, cost curves, an open round) written by 0.1.0.

    Returns GET /v1/pairs by id, the history by id, and the old release's version.
    """
    plans = [
        (trace_slice("chat", 0, 250), pb.UPDATE_RULE_VLLM, 30, {}),
        (trace_slice("code", 0, 180), pb.UPDATE_RULE_RECURSIVE, 25, {}),
        (trace_slice("sample", 0, 77), pb.UPDATE_RULE_RECURSIVE, 20, {"workload": "chat"}),
    ]
    with OldServer(data_dir) as old:
        channel, stub = stub_for(old.grpc_address)
        for n, (trace, rule, interval, labels) in enumerate(plans):
            key = pair_key(trace)
            key.labels.update(labels)
            reg = stub.RegisterPair(
                pb.RegisterPairRequest(key=key, update_rule=rule, refit_interval=interval)
            )
            for w in range(2):
                msgs = messages_for(trace, reg.pair_id, w, 2, f"old-worker-{n}-{w}", 1)
                last = 0
                for resp in stub.Observe(iter(msgs), timeout=60):
                    if resp.HasField("ack"):
                        last = resp.ack.acked_sequence
                assert last == len(msgs)
            if n == 2:
                stub.SetCostCurves(
                    pb.SetCostCurvesRequest(
                        pair_id=reg.pair_id,
                        hardware="H200",
                        draft_curve=[pb.CostPoint(size=1, ms=1.0), pb.CostPoint(size=64, ms=2.0)],
                        verify_curve=[pb.CostPoint(size=1, ms=5.0), pb.CostPoint(size=512, ms=9.0)],
                        cudagraph_capture_limit=256,
                    )
                )
        channel.close()
        with httpx.Client(base_url=old.http_url, timeout=10) as http:
            pairs = {p["id"]: p for p in http.get("/v1/pairs").json()["pairs"]}
            history = {pid: http.get(f"/v1/pairs/{pid}/history").json() for pid in pairs}
        version = old.version()
        assert old.stop() == 0
    return pairs, history, version


def test_a_store_written_by_0_1_0_opens_with_identical_pairs(tmp_path, trace_slice):
    data = tmp_path / "data"
    before, history, old_version = _write_with_old_release(data, trace_slice)
    assert old_version == "0.1.0"
    assert len(before) == 3
    assert {p["rule"] for p in before.values()} == {"vllm", "recursive"}
    assert all(p["last_outcome"] for p in before.values())  # every pair refitted
    assert any(p["steps_in_round"] for p in before.values())  # an open round to carry
    db = data / "avest.sqlite3"
    with sqlite3.connect(db) as c:  # what 0.1.0 leaves: no version anywhere
        assert c.execute("PRAGMA user_version").fetchone()[0] == 0

    srv = launch(data)
    try:
        with httpx.Client(base_url=srv.http_url, timeout=10) as http:
            after = {p["id"]: p for p in http.get("/v1/pairs").json()["pairs"]}
            assert after.keys() == before.keys()
            for pid, old in before.items():
                new = after[pid]
                for field in SAME:
                    assert _same(new[field], old[field]), (pid, field)
                assert http.get(f"/v1/pairs/{pid}/history").json() == history[pid]
            assert http.get("/readyz").json() == {"status": "ready"}
    finally:
        srv.stop()
    # Migrated in place, the 0.1.0 file kept beside it, the format recorded.
    assert (data / "avest.sqlite3.format1.bak").is_file()
    with sqlite3.connect(db) as c:
        assert c.execute("PRAGMA user_version").fetchone()[0] == STORE_FORMAT
        assert dict(c.execute("SELECT key, value FROM meta"))["format"] == str(STORE_FORMAT)
        assert c.execute("SELECT DISTINCT format FROM snapshots").fetchall() == [(BLOB_FORMAT,)]
        assert c.execute("SELECT COUNT(*) FROM workers").fetchone()[0] == 6
    # And the upgraded store restarts as it was (last_outcome survives a clean restart).
    srv = launch(data)
    try:
        with httpx.Client(base_url=srv.http_url, timeout=10) as http:
            again = {p["id"]: p for p in http.get("/v1/pairs").json()["pairs"]}
        for pid, old in before.items():
            for field in SAME:
                assert _same(again[pid][field], old[field]), (pid, field)
    finally:
        srv.stop()


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_a_store_from_a_newer_release_is_refused_unread(tmp_path, trace_slice):
    data = tmp_path / "data"
    srv = launch(data)
    try:
        channel, stub = stub_for(srv.grpc_address)
        stub.RegisterPair(pb.RegisterPairRequest(key=pair_key(trace_slice("sample", 0, 10))))
        channel.close()
    finally:
        srv.stop()
    db = data / "avest.sqlite3"
    with sqlite3.connect(db) as c:
        c.execute(f"PRAGMA user_version = {STORE_FORMAT + 1}")
        c.execute("UPDATE meta SET value = '9.0.0' WHERE key = 'written_by'")
    with sqlite3.connect(db) as c:
        c.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    digest = _digest(db)
    with pytest.raises(StoreTooNew) as refused:
        launch(data)
    message = str(refused.value)
    assert f"store format {STORE_FORMAT + 1}" in message and "avest 9.0.0" in message
    assert f"reads formats up to {STORE_FORMAT}" in message
    assert _digest(db) == digest  # never half-read, nothing written


def test_a_snapshot_blob_from_a_newer_release_is_refused(tmp_path):
    db = tmp_path / "avest.sqlite3"
    store = Store(db)
    arrays = {"counters": np.zeros(5)}
    store.write(
        [
            {
                "id": "p1",
                "key": {"target": "t", "draft": "d", "method": "m", "k": 1, "labels": {}},
                "rule": "vllm",
                "refit_interval": 10,
                "arrays": arrays,
                "workers": {},
                "costs": [],
                "history": [],
                "updated": 0.0,
            }
        ]
    )
    blob = store.db.execute("SELECT arrays FROM snapshots").fetchone()[0]
    newer = blob[:4] + (BLOB_FORMAT + 1).to_bytes(2, "big") + blob[6:]
    store.db.execute("UPDATE snapshots SET arrays = ?", (newer,))
    with pytest.raises(StoreTooNew, match=f"reads formats up to {BLOB_FORMAT}"):
        store.load()
    store.close()
