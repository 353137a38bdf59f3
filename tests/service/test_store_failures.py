"""A store write that fails is reported as what failed (disk full, I/O error), never as
the rollback after it; nothing acknowledged is lost, and writes resume once the disk
takes them again.

SQLite rolls a whole transaction back by itself after some errors; the ROLLBACK that
followed then failed with "cannot rollback - no transaction is active", which was
raised in place of the cause. The faults are real: SQLite's own page limit
(``PRAGMA max_page_count``) makes it answer "database or disk is full", and a file
size limit on the service's process (``RLIMIT_FSIZE``: the kernel refuses writes past
it, EFBIG) makes it answer "disk I/O error" (SQLITE_IOERR_WRITE, the code SQLite
gives every failed write but ENOSPC, EIO among them).
"""

from __future__ import annotations

import resource
import sqlite3
import threading
from typing import Any

import httpx
import numpy as np
import pytest

from avest.state import store_format
from avest.state.store import Store
from avest_wire.v1 import estimator_pb2 as pb
from tests.support.helpers import wait_until
from tests.support.rpc import observe_all, register_k, stub_for, synthetic_steps
from tests.support.serve import serve
from tests.support.server import launch

K = 4
#: History rows of the write that fills the file: far more than one free page holds.
HISTORY_ROWS = 400
#: Seconds allowed for a condition on a loaded machine (never a measured duration).
WAIT_S = 60.0


def _record(history: range) -> dict[str, Any]:
    """One pair's snapshot as ``Registry.snapshot`` gives it, with ``history`` entries."""
    return {
        "id": "p1",
        "key": {"target": "t", "draft": "d", "method": "m", "k": K, "labels": {}},
        "rule": "vllm",
        "refit_interval": 10,
        "arrays": {"counters": np.zeros(5), "x": np.linspace(0.0, 1.0, 3000)},
        "workers": {"w": (1, 0.0)},
        "costs": [],
        "history": [
            {
                "version": i,
                "round": i,
                "time": float(i),
                "slope": 1.0,
                "intercepts": [0.1] * K,
                "outcome": "applied",
            }
            for i in history
        ],
        "updated": 0.0,
    }


def _history_rows(store: Store) -> int:
    return int(store.db.execute("SELECT COUNT(*) FROM coefficient_history").fetchone()[0])


def test_a_full_disk_that_rolls_the_transaction_back_is_reported_as_full(tmp_path):
    store = Store(tmp_path / "avest.sqlite3")
    store.write([_record(range(10))])
    store.db.execute("VACUUM")  # no free pages left to reuse
    pages = store.db.execute("PRAGMA page_count").fetchone()[0]
    store.db.execute(f"PRAGMA max_page_count = {pages}")
    with pytest.raises(sqlite3.OperationalError) as failed:
        store.write([_record(range(10, 10 + HISTORY_ROWS))])
    # SQLite gave up the whole transaction itself: the cause is what rises.
    assert str(failed.value) == "database or disk is full"
    assert not getattr(failed.value, "__notes__", None)
    assert not store.db.in_transaction
    assert _history_rows(store) == 10  # nothing of the failed write
    # Room again: the same write goes through whole.
    store.db.execute("PRAGMA max_page_count = 1073741823")
    store.write([_record(range(10, 10 + HISTORY_ROWS))])
    assert _history_rows(store) == 10 + HISTORY_ROWS
    store.close()


def test_a_full_disk_while_a_store_is_created_is_reported_as_full(tmp_path):
    db = sqlite3.connect(tmp_path / "avest.sqlite3", isolation_level=None)
    db.execute("PRAGMA journal_mode=WAL")
    db.execute("PRAGMA max_page_count = 3")  # fewer pages than the tables take
    with pytest.raises(sqlite3.OperationalError, match="^database or disk is full$"):
        store_format.migrate(db, 0)
    assert db.execute("SELECT COUNT(*) FROM sqlite_master").fetchone()[0] == 0
    db.execute("PRAGMA max_page_count = 1073741823")
    store_format.migrate(db, 0)
    assert db.execute("PRAGMA user_version").fetchone()[0] == store_format.STORE_FORMAT
    db.close()


def test_a_transaction_left_open_does_not_block_the_next_write(tmp_path):
    store = Store(tmp_path / "avest.sqlite3")
    store.db.execute("BEGIN IMMEDIATE")  # as a rollback that failed would leave it
    store.db.execute("DELETE FROM meta")
    store.write([_record(range(3))])
    assert _history_rows(store) == 3
    assert store.db.execute("SELECT COUNT(*) FROM meta").fetchone()[0] > 0  # undone
    store.close()


# -- a service whose disk refuses its writes ---------------------------------------------

#: Bytes the service's files may grow past its log's size when the fault starts: less
#: than one group commit of a K = 64 pair writes (its snapshot alone is tens of kB).
ROOM_BYTES = 16 * 1024


def _readyz(url: str) -> dict[str, Any]:
    return dict(httpx.get(url + "/readyz", timeout=10).json())


def test_an_io_error_is_reported_as_such_and_nothing_acknowledged_is_lost(tmp_path):
    data = tmp_path / "data"
    served = serve(data, "--flush-interval-ms", "20")
    try:
        channel, stub = stub_for(served.grpc_address)
        pair_id = register_k(stub, 64, 0, refit_interval=5).pair_id
        steps = synthetic_steps(pair_id, "w", 64, 60, seed=1)
        assert observe_all(stub, steps[:20])[0] == 20
        pid = served.proc.pid
        soft, hard = resource.prlimit(pid, resource.RLIMIT_FSIZE)
        resource.prlimit(pid, resource.RLIMIT_FSIZE, (served.log_bytes() + ROOM_BYTES, hard))

        acked: list[int] = []
        done = threading.Event()

        def requests():  # noqa: ANN202
            yield from steps[20:]
            done.wait(WAIT_S)

        def consume() -> None:
            for resp in stub.Observe(requests(), timeout=3 * WAIT_S):
                if resp.HasField("ack"):
                    acked.append(resp.ack.acked_sequence)
                    if resp.ack.acked_sequence == 60:
                        done.set()

        reader = threading.Thread(target=consume)
        reader.start()
        try:
            assert wait_until(
                lambda: _readyz(served.http_url).get("status") == "store-error", WAIT_S
            ), served.output()[-3000:]
            reason = _readyz(served.http_url)["reason"]
            assert "store I/O error: " in reason and "disk I/O error" in reason, reason
            assert "cannot rollback" not in reason and "malformed" not in reason, reason
            assert wait_until(lambda: "disk I/O error" in served.output(), WAIT_S)
            log = served.output()
            assert "cannot rollback" not in log, log[-3000:]
            assert "WARNING" in log
            # The disk takes writes again: every step is acknowledged, readiness returns.
            resource.prlimit(pid, resource.RLIMIT_FSIZE, (soft, hard))
            assert done.wait(WAIT_S), (acked[-5:], served.output()[-3000:])
        finally:
            done.set()
            reader.join(WAIT_S)
        assert wait_until(lambda: _readyz(served.http_url).get("status") == "ready", WAIT_S)
        channel.close()
    finally:
        assert served.stop() == 0
    srv = launch(data)
    try:
        channel, stub = stub_for(srv.grpc_address)
        pair = stub.GetPair(pb.GetPairRequest(pair_id=pair_id), timeout=10).pair
        channel.close()
        assert pair.steps_observed == 60  # all acknowledged, all durable
    finally:
        srv.stop()
