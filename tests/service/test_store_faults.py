"""Storage faults: an emptied store, a corrupt snapshot or page, failing writes, and
what a clean restart keeps. Real servers on real SQLite files; faults made on disk
or with SQLite's own limits (read-only, full)."""

from __future__ import annotations

import asyncio
import sqlite3
import threading
import time
from pathlib import Path

import grpc
import httpx
import pytest

from avest.state.guard import StoreEmptied
from avest_wire.v1 import estimator_pb2 as pb
from tests.support.rpc import (
    messages_for,
    observe_all,
    pairs_by_id,
    register,
    register_k,
    stub_for,
    synthetic_steps,
)
from tests.support.server import ADMIN, ServerHandle, launch, populate

pytestmark = pytest.mark.slow


def _metric(srv: ServerHandle, name: str, labels: str = "") -> float | None:
    text = httpx.get(f"{srv.http_url}/metrics", timeout=10).text
    for line in text.splitlines():
        if line.startswith(f"{name}{labels} ") or (not labels and line.startswith(f"{name} ")):
            return float(line.split()[-1])
    return None


# -- an emptied store ----------------------------------------------------------------


@pytest.mark.parametrize("fault", ["truncated", "deleted"])
def test_a_store_that_held_pairs_and_is_now_empty_refuses_to_start(tmp_path, trace_slice, fault):
    data = tmp_path / "data"
    populate(data, pairs=2)
    db = data / "avest.sqlite3"
    for extra in (Path(f"{db}-wal"), Path(f"{db}-shm")):
        extra.unlink(missing_ok=True)
    if fault == "truncated":
        db.write_bytes(b"")
    else:
        db.unlink()
    with pytest.raises(StoreEmptied) as refused:
        launch(data)
    assert "2 pair(s)" in str(refused.value) and "--allow-empty-store" in str(refused.value)
    # Said on purpose: it starts afresh, and records the new (empty) state.
    srv = launch(data, allow_empty_store=True)
    try:
        assert pairs_by_id(srv.grpc_address) == {}
    finally:
        srv.stop()
    srv = launch(data)
    srv.stop()


def test_a_store_emptied_of_rows_refuses_to_start(tmp_path, trace_slice):
    data = tmp_path / "data"
    populate(data, pairs=1)
    with sqlite3.connect(data / "avest.sqlite3") as c:
        c.execute("PRAGMA foreign_keys=OFF")
        for table in ("snapshots", "workers", "coefficient_history", "cost_curves", "pairs"):
            c.execute(f"DELETE FROM {table}")
    with pytest.raises(StoreEmptied, match="holds no pairs"):
        launch(data)


# -- corrupt snapshots and pages ------------------------------------------------------


def _file_offset(db: Path, pair_id: str) -> tuple[int, int]:
    """Where a pair's snapshot blob lies in the database file (offset, page size)."""
    c = sqlite3.connect(db)
    try:
        c.execute("VACUUM")  # no stale copies of the row in free pages
        c.execute("PRAGMA wal_checkpoint(TRUNCATE)")  # everything in the main file
        blob = bytes(
            c.execute("SELECT arrays FROM snapshots WHERE pair_id = ?", (pair_id,)).fetchone()[0]
        )
        page = c.execute("PRAGMA page_size").fetchone()[0]
    finally:
        c.close()
    raw = db.read_bytes()
    for off in range(0, len(blob) - 64, 61):
        probe = blob[off : off + 64]
        at = raw.find(probe)
        if at < 0 or raw.find(probe, at + 1) != -1:
            continue
        start = at - at % page
        # An overflow page of this blob alone: after its 4-byte link, only the blob's bytes.
        if raw[start + 4 : start + page] in blob:
            return at, page
    raise AssertionError(f"no overflow page of its own for a {len(blob)}-byte blob")


@pytest.mark.parametrize("fault", ["flipped-byte", "garbage-page"])
def test_a_corrupt_snapshot_quarantines_its_pair_and_the_others_serve(tmp_path, trace_slice, fault):
    data = tmp_path / "data"
    before = populate(data, pairs=3)
    bad = sorted(before)[1]
    db = data / "avest.sqlite3"
    at, page = _file_offset(db, bad)
    raw = bytearray(db.read_bytes())
    if fault == "flipped-byte":
        raw[at + 10] ^= 0x5A
    else:
        start = at - at % page
        raw[start : start + page] = bytes([0xA7]) * page
    db.write_bytes(bytes(raw))

    srv = launch(data)
    try:
        pairs = pairs_by_id(srv.grpc_address)
        assert set(pairs) == set(before) - {bad}
        for pid, pair in pairs.items():
            assert pair == before[pid]
        ready = httpx.get(f"{srv.http_url}/readyz", timeout=10)
        assert ready.status_code == 200
        body = ready.json()
        assert body["status"] == "ready" and list(body["quarantined"]) == [bad]
        assert _metric(srv, "avest_quarantined_pairs") == 1.0
        # The key is refused until an admin deletes what was set aside; then it
        # registers afresh and serves.
        channel, stub = stub_for(srv.grpc_address)
        with pytest.raises(grpc.RpcError) as refused:
            register_k(stub, 64, int(before[bad].key.labels["n"]))
        assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "set aside" in (refused.value.details() or "")
        stub.DeletePair(pb.DeletePairRequest(pair_id=bad), metadata=ADMIN)
        assert httpx.get(f"{srv.http_url}/readyz", timeout=10).json() == {"status": "ready"}
        assert _metric(srv, "avest_quarantined_pairs") == 0.0
        reg = register_k(stub, 64, int(before[bad].key.labels["n"]))
        assert reg.pair_id == bad and reg.created and reg.coefficients.version == 0
        observe_all(stub, synthetic_steps(bad, "again", 64, 12, seed=9))
        assert httpx.get(f"{srv.http_url}/readyz", timeout=10).status_code == 200
        assert _metric(srv, "avest_store_writable") == 1.0
        channel.close()
    finally:
        srv.stop()
    with sqlite3.connect(db) as c:
        kept = c.execute("SELECT pair_id, reason FROM quarantine").fetchall()
    assert kept == []  # the admin's delete dropped what was set aside
    aside = list(data.glob("avest.sqlite3.corrupt-*"))
    # A damaged page could not even be deleted: the file was rebuilt, the old one kept.
    assert len(aside) == (1 if fault == "garbage-page" else 0)


# -- failing writes ----------------------------------------------------------------------


@pytest.mark.parametrize("fault", ["read-only", "disk-full"])
def test_write_errors_show_on_readyz_and_metrics_and_acks_resume(tmp_path, trace_slice, fault):
    srv = launch(tmp_path / "data")
    try:
        app = srv.server.app
        trace = trace_slice("sample", 0, 80)
        channel, stub = stub_for(srv.grpc_address)
        reg = register(stub, trace, "recursive", 10)
        msgs = messages_for(trace, reg.pair_id, 0, 1, "w", 1)
        assert observe_all(stub, msgs[:20])[0] == 20

        async def on_writer(sql: str) -> None:
            loop = asyncio.get_running_loop()
            await loop.run_in_executor(app._writer, app.store.db.execute, sql)

        if fault == "read-only":
            srv.call(on_writer, "PRAGMA query_only = 1")
        else:  # the file may not grow by a page: SQLite's own "database or disk is full"
            srv.call(on_writer, "VACUUM")
            pages = srv.call(
                lambda: asyncio.get_running_loop().run_in_executor(
                    app._writer, lambda: app.store.db.execute("PRAGMA page_count").fetchone()[0]
                )
            )
            srv.call(on_writer, f"PRAGMA max_page_count = {pages}")
        # 40 new workers (long ids): their records need new pages.
        later = []
        for n, m in enumerate(msgs[20:60]):
            m2 = pb.ObserveRequest()
            m2.CopyFrom(m)
            m2.worker_id, m2.sequence = f"worker-{n:03d}-" + "x" * 110, 1
            later.append(m2)
        acked: dict[str, int] = {}
        all_acked = threading.Event()

        def requests():
            yield from later
            all_acked.wait(30)

        def consume() -> None:
            for resp in stub.Observe(requests(), timeout=60):
                if resp.HasField("ack"):
                    acked[resp.ack.worker_id] = resp.ack.acked_sequence
                    if len(acked) == len(later):
                        all_acked.set()

        reader = threading.Thread(target=consume)
        reader.start()
        deadline = time.monotonic() + 10
        while not app.store_error and time.monotonic() < deadline:
            time.sleep(0.02)
        ready = httpx.get(f"{srv.http_url}/readyz", timeout=10)
        assert ready.status_code == 503
        assert ready.json()["status"] == "store-error"
        reason = ready.json()["reason"]
        assert ("readonly" in reason) if fault == "read-only" else ("full" in reason), reason
        assert _metric(srv, "avest_store_errors_total", '{operation="write"}') >= 1
        assert _metric(srv, "avest_store_writable") == 0.0
        # Nothing is acknowledged while nothing can be made durable.
        stuck = dict(acked)
        time.sleep(0.5)
        assert acked == stuck and len(stuck) < 40
        # The disk is writable again: acks resume, readiness returns.
        srv.call(
            on_writer,
            "PRAGMA query_only = 0"
            if fault == "read-only"
            else "PRAGMA max_page_count = 1073741823",
        )
        reader.join(30)
        channel.close()
        assert len(acked) == 40 and set(acked.values()) == {1}
        assert httpx.get(f"{srv.http_url}/readyz", timeout=10).status_code == 200
        assert _metric(srv, "avest_store_writable") == 1.0
    finally:
        srv.stop()
    srv = launch(tmp_path / "data")
    try:
        assert (
            pairs_by_id(srv.grpc_address)[reg.pair_id].steps_observed == 60
        )  # 20 + 40, all durable
    finally:
        srv.stop()


# -- a clean restart -------------------------------------------------------------------


def test_last_outcome_survives_a_clean_restart(tmp_path):
    data = tmp_path / "data"
    srv = launch(data)
    try:
        channel, stub = stub_for(srv.grpc_address)
        reg = register_k(stub, 8, 0)
        observe_all(stub, synthetic_steps(reg.pair_id, "w", 8, 35, seed=3))
        channel.close()
        before = httpx.get(f"{srv.http_url}/v1/pairs/{reg.pair_id}", timeout=10).json()
    finally:
        srv.stop()
    assert before["last_outcome"] in ("applied", "slope_held", "rejected")
    srv = launch(data)
    try:
        after = httpx.get(f"{srv.http_url}/v1/pairs/{reg.pair_id}", timeout=10).json()
    finally:
        srv.stop()
    assert after["last_outcome"] == before["last_outcome"]
    assert (after["round"], after["version"]) == (before["round"], before["version"])
