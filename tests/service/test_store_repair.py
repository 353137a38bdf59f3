"""The store fails narrowly and says what failed.

Damage the SQLite file can repair itself (an index page) is repaired at start and
every pair serves; damage to rows sets aside only the pairs whose own rows cannot be
read, and a file that cannot be repaired is set aside unchanged (nothing written into
it first). A pair set aside is not registered again, empty, until an admin deletes
it; ``/readyz`` names the pairs set aside, and answers 503 when none of the stored
pairs can be served. A disk that refuses to read or write is an I/O error ("store I/O
error: ..."), never damage: nothing is set aside for it.

Real servers on real SQLite files, damaged on disk. The I/O errors are real where a
test can make them (a file size limit on a ``avest serve`` process: the kernel refuses
its writes, EFBIG, which SQLite reports as SQLITE_IOERR_WRITE); a failing disk's reads
are injected where the disk answers: a connection whose reads fail as SQLite reports
them (SQLITE_IOERR_READ; or SQLITE_CORRUPT, which is how SQLite reports EIO on a read)
and, for the latter, the service reading the file back (EIO).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import random
import sqlite3
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest

from avest.state import store as store_module
from avest.state.store import Store
from avest_wire.v1 import estimator_pb2 as pb
from tests.support.helpers import wait_until
from tests.support.rpc import (
    observe_all,
    pairs_by_id,
    register_k,
    stub_for,
    synthetic_steps,
)
from tests.support.server import ADMIN, launch, populate

pytestmark = pytest.mark.slow

DATABASE = "avest.sqlite3"
K = 64
#: Seconds allowed for a condition on a loaded machine (never a measured duration).
WAIT_S = 60.0


# -- helpers ---------------------------------------------------------------------------


def _settled(db: Path) -> int:
    """Everything in the main file (no WAL, no free pages); the page size."""
    c = sqlite3.connect(db)
    try:
        c.execute("VACUUM")
        c.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        return int(c.execute("PRAGMA page_size").fetchone()[0])
    finally:
        c.close()


def _root(db: Path, name: str) -> int:
    c = sqlite3.connect(db)
    try:
        return int(
            c.execute("SELECT rootpage FROM sqlite_master WHERE name = ?", (name,)).fetchone()[0]
        )
    finally:
        c.close()


def _overwrite(db: Path, page: int, size: int, data: bytes) -> bytes:
    """Write ``data`` over page ``page`` (1-based) of the file; the file's new bytes."""
    raw = bytearray(db.read_bytes())
    raw[(page - 1) * size : page * size] = data
    db.write_bytes(bytes(raw))
    return bytes(raw)


def _blob_page(db: Path, pair_id: str, size: int) -> int:
    """A page holding only bytes of the pair's snapshot blob (an overflow page)."""
    c = sqlite3.connect(db)
    try:
        blob = bytes(
            c.execute("SELECT arrays FROM snapshots WHERE pair_id = ?", (pair_id,)).fetchone()[0]
        )
    finally:
        c.close()
    raw = db.read_bytes()
    for off in range(0, len(blob) - 64, 61):
        at = raw.find(blob[off : off + 64])
        if at < 0 or raw.find(blob[off : off + 64], at + 1) != -1:
            continue
        start = at - at % size
        if raw[start + 4 : start + size] in blob:  # after its 4-byte link, the blob alone
            return start // size + 1
    raise AssertionError(f"no overflow page of its own for a {len(blob)}-byte blob")


def _rows(db: Path, sql: str) -> list[tuple[Any, ...]]:
    c = sqlite3.connect(db)
    try:
        return list(c.execute(sql).fetchall())
    finally:
        c.close()


def _aside(data: Path) -> list[Path]:
    """The files set aside (their WAL and shared memory, if any, not counted)."""
    return sorted(
        p for p in data.glob(f"{DATABASE}.corrupt-*") if not p.name.endswith(("-wal", "-shm"))
    )


def _readyz(srv: Any) -> httpx.Response:
    return httpx.get(f"{srv.http_url}/readyz", timeout=10)


def _serves_every_pair(data: Path, before: dict[str, pb.Pair]) -> None:
    """A server started on ``data`` serves every pair as it was, and is ready."""
    srv = launch(data)
    try:
        assert pairs_by_id(srv.grpc_address) == before
        assert _readyz(srv).json() == {"status": "ready"}
    finally:
        srv.stop()


def _register(srv: Any, n: int) -> pb.RegisterPairResponse:
    channel, stub = stub_for(srv.grpc_address)
    try:
        return register_k(stub, K, n)
    finally:
        channel.close()


def _refused(srv: Any, n: int) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as refused:
        _register(srv, n)
    return refused.value


def _messages(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "avest"]


# -- damage the store repairs itself --------------------------------------------------


@pytest.mark.parametrize(
    "index",
    [
        "sqlite_autoindex_workers_1",
        "sqlite_autoindex_pairs_1",
        "sqlite_autoindex_snapshots_1",
        "sqlite_autoindex_coefficient_history_1",
    ],
)
def test_random_bytes_on_an_index_page_are_repaired_at_start_and_every_pair_serves(
    tmp_path, caplog, index
):
    data = tmp_path / "data"
    before = populate(data, k=K)
    db = data / DATABASE
    size = _settled(db)
    noise = random.Random(index).randbytes(size)
    damaged = _overwrite(db, _root(db, index), size, noise)
    caplog.set_level(logging.INFO, logger="avest")

    srv = launch(data)
    try:
        assert pairs_by_id(srv.grpc_address) == before  # every pair, as it was
        ready = _readyz(srv)
        assert ready.status_code == 200 and ready.json() == {"status": "ready"}
        # Writes go on into the repaired file.
        fed = sorted(before)[0]
        channel, stub = stub_for(srv.grpc_address)
        observe_all(stub, synthetic_steps(fed, "later", K, 12, seed=7))
        after = stub.GetPair(pb.GetPairRequest(pair_id=fed)).pair
        channel.close()
    finally:
        srv.stop()
    said = [m for m in _messages(caplog) if m.startswith("store repaired at start")]
    assert len(said) == 1 and index in said[0], _messages(caplog)
    assert not [m for m in _messages(caplog) if "quarantined" in m]
    # The damaged file is kept aside as it was; the new one passes the check.
    (aside,) = _aside(data)
    assert aside.read_bytes() == damaged and aside.name in said[0]
    assert _rows(db, "PRAGMA integrity_check") == [("ok",)]

    caplog.clear()
    srv = launch(data)
    try:
        assert pairs_by_id(srv.grpc_address) == {**before, fed: after}
    finally:
        srv.stop()
    assert not [m for m in _messages(caplog) if "repaired" in m or "integrity" in m]


def test_an_index_that_disagrees_with_its_table_is_rebuilt_in_place(tmp_path, caplog):
    data = tmp_path / "data"
    before = populate(data, k=K)
    db = data / DATABASE
    size = _settled(db)
    page = _root(db, "sqlite_autoindex_workers_1")
    pid = sorted(before)[0]
    entry = f"{pid}w{before[pid].key.labels['n']}".encode()
    raw = bytearray(db.read_bytes())
    at = raw.find(entry, (page - 1) * size, page * size)
    assert at >= 0, "the index entry of the pair's worker"
    # The index names a worker ("x0") the table does not hold: every page still parses.
    raw[at + len(entry) - 2] = ord("x")
    db.write_bytes(bytes(raw))
    assert _rows(db, "PRAGMA quick_check") == [("ok",)]
    assert _rows(db, "PRAGMA integrity_check") != [("ok",)]
    caplog.set_level(logging.INFO, logger="avest")

    _serves_every_pair(data, before)
    said = [m for m in _messages(caplog) if m.startswith("store repaired at start")]
    assert len(said) == 1 and "REINDEX rebuilt the indexes" in said[0], _messages(caplog)
    assert "sqlite_autoindex_workers_1" in said[0]
    assert _aside(data) == []  # repaired in place: nothing set aside
    assert _rows(db, "PRAGMA integrity_check") == [("ok",)]


# -- damage to rows: only their pair ----------------------------------------------------


def test_only_the_pair_whose_rows_are_unreadable_is_set_aside_and_its_file_left_as_it_was(
    tmp_path, caplog
):
    data = tmp_path / "data"
    before = populate(data, k=K)
    bad = sorted(before)[1]
    n_bad = int(before[bad].key.labels["n"])
    db = data / DATABASE
    size = _settled(db)
    damaged = _overwrite(db, _blob_page(db, bad, size), size, bytes([0xA7]) * size)
    caplog.set_level(logging.INFO, logger="avest")

    srv = launch(data)
    try:
        pairs = pairs_by_id(srv.grpc_address)
        assert pairs == {pid: p for pid, p in before.items() if pid != bad}
        ready = _readyz(srv)
        assert ready.status_code == 200
        body = ready.json()
        assert body["status"] == "ready" and list(body["quarantined"]) == [bad]
        # Not registered again, empty, behind the operator's back.
        refused = _refused(srv, n_bad)
        assert refused.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert f"pair {bad} is set aside" in refused.details()
        assert "until an admin deletes it" in refused.details()
        assert bad not in pairs_by_id(srv.grpc_address)
        # Another key registers as ever.
        assert _register(srv, 7).created
    finally:
        srv.stop()
    # Nothing was written into the damaged file before it was set aside.
    (aside,) = _aside(data)
    assert aside.read_bytes() == damaged
    (kept,) = _rows(db, "SELECT pair_id, reason, key_json FROM quarantine")
    assert kept[0] == bad and aside.name in kept[1] and f'"n": "{n_bad}"' in kept[2]
    rebuilt = [m for m in _messages(caplog) if m.startswith("store damaged")]
    assert len(rebuilt) == 1 and "2 readable pair(s)" in rebuilt[0]

    # The next start still sets it aside, and still refuses it.
    srv = launch(data)
    try:
        assert bad not in pairs_by_id(srv.grpc_address)
        assert list(_readyz(srv).json()["quarantined"]) == [bad]
        assert _refused(srv, n_bad).code() == grpc.StatusCode.FAILED_PRECONDITION
    finally:
        srv.stop()


def test_readyz_is_503_while_none_of_the_stored_pairs_can_be_served(tmp_path):
    data = tmp_path / "data"
    before = populate(data, k=K)
    db = data / DATABASE
    with sqlite3.connect(db) as c:
        c.execute("UPDATE snapshots SET checksum = 'not the checksum'")
    c.close()

    srv = launch(data)
    try:
        assert pairs_by_id(srv.grpc_address) == {}
        ready = _readyz(srv)
        assert ready.status_code == 503
        body = ready.json()
        assert body["status"] == "quarantined" and set(body["quarantined"]) == set(before)
        assert "none of the 3 stored pair(s) can be served" in body["reason"]
        assert all("checksum mismatch" in why for why in body["quarantined"].values())
        # A new pair serves: ready again, the others still named.
        assert _register(srv, 7).created
        ready = _readyz(srv)
        assert ready.status_code == 200 and set(ready.json()["quarantined"]) == set(before)
    finally:
        srv.stop()
    # Set aside in place (the file itself is sound): its rows moved to the quarantine table.
    assert _aside(data) == []
    kept = _rows(db, "SELECT pair_id, key_json IS NOT NULL, arrays IS NOT NULL FROM quarantine")
    assert sorted(kept) == sorted((pid, 1, 1) for pid in before)


def test_deleting_a_set_aside_pair_from_the_store_frees_its_id(tmp_path):
    data = tmp_path / "data"
    before = populate(data, pairs=2, k=K)
    gone, kept = sorted(before)
    db = data / DATABASE
    with sqlite3.connect(db) as c:
        c.execute("UPDATE snapshots SET checksum = 'x' WHERE pair_id = ?", (gone,))
    c.close()
    launch(data).stop()  # sets it aside

    store = Store(db)
    try:
        loaded = store.load_at_start()
        assert [r["id"] for r in loaded.records] == [kept]
        assert list(loaded.set_aside) == [gone] and "checksum mismatch" in loaded.set_aside[gone]
        store.delete(gone)
        assert store.load_at_start().set_aside == {}
    finally:
        store.close()
    assert _rows(db, "SELECT COUNT(*) FROM quarantine") == [(0,)]

    srv = launch(data)
    try:
        assert _readyz(srv).json() == {"status": "ready"}
        reg = _register(srv, int(before[gone].key.labels["n"]))
        assert reg.pair_id == gone and reg.created and reg.coefficients.version == 0
    finally:
        srv.stop()


def test_an_admin_deletes_a_set_aside_pair_and_its_key_registers_afresh(tmp_path):
    data = tmp_path / "data"
    before = populate(data, pairs=1, k=K)
    (gone,) = before
    with sqlite3.connect(data / DATABASE) as c:
        c.execute("UPDATE snapshots SET checksum = 'x'")
    c.close()
    srv = launch(data)
    try:
        assert _refused(srv, 0).code() == grpc.StatusCode.FAILED_PRECONDITION
        deleted = httpx.delete(f"{srv.http_url}/v1/pairs/{gone}", headers=dict(ADMIN), timeout=10)
        assert deleted.status_code == 200, deleted.text
        assert _readyz(srv).json() == {"status": "ready"}
        assert _register(srv, 0).created
    finally:
        srv.stop()


# -- a disk that refuses ----------------------------------------------------------------


def _disk_error(fault: str) -> sqlite3.DatabaseError:
    """The error SQLite raises when the disk refuses a read: SQLITE_IOERR_READ, or
    (EIO, on Unix) SQLITE_CORRUPT, "database disk image is malformed"."""
    if fault == "io-error":
        exc: sqlite3.DatabaseError = sqlite3.OperationalError("disk I/O error")
        exc.sqlite_errorcode, exc.sqlite_errorname = sqlite3.SQLITE_IOERR_READ, "SQLITE_IOERR_READ"
    else:
        exc = sqlite3.DatabaseError("database disk image is malformed")
        exc.sqlite_errorcode, exc.sqlite_errorname = sqlite3.SQLITE_CORRUPT, "SQLITE_CORRUPT"
    return exc


def _refuse_reads(
    monkeypatch: pytest.MonkeyPatch,
    db: Path,
    fault: str,
    refused: Callable[[str, Sequence[Any]], bool],
) -> None:
    """The store's connections to ``db`` fail the reads ``refused`` picks as a failing
    disk would; with ``eio-read-as-corrupt``, reading the file back fails with EIO."""

    class RefusingReads(sqlite3.Connection):
        def execute(self, sql: str, parameters: Sequence[Any] = (), /) -> sqlite3.Cursor:
            if refused(sql, parameters):
                raise _disk_error(fault)
            return super().execute(sql, parameters)

    connect = sqlite3.connect

    def connecting(path: Any, *args: Any, **kwargs: Any) -> sqlite3.Connection:
        if Path(path) == db:
            kwargs["factory"] = RefusingReads
        return connect(path, *args, **kwargs)

    monkeypatch.setattr(sqlite3, "connect", connecting)
    if fault == "eio-read-as-corrupt":
        read_back = store_module.read_back

        def failing(path: Path) -> None:
            if Path(path).name.startswith(db.name):
                raise OSError(errno.EIO, "Input/output error", str(path))
            read_back(path)

        monkeypatch.setattr(store_module, "read_back", failing)


@pytest.mark.parametrize("fault", ["io-error", "eio-read-as-corrupt"])
@pytest.mark.parametrize("which", ["one", "all"])
def test_a_disk_that_refuses_reads_is_an_io_error_and_nothing_is_set_aside(
    tmp_path, monkeypatch, caplog, fault, which
):
    data = tmp_path / "data"
    before = populate(data, k=K)
    db = data / DATABASE
    bad = set(before) if which == "all" else {sorted(before)[1]}

    def refused(sql: str, parameters: Sequence[Any]) -> bool:
        if sql.startswith("PRAGMA") and "check" in sql:
            return True  # the check reads every page: it meets the failing one too
        return "snapshots" in sql and bool(set(parameters) & bad)

    _refuse_reads(monkeypatch, db, fault, refused)
    caplog.set_level(logging.INFO, logger="avest")
    srv = launch(data)
    try:
        assert pairs_by_id(srv.grpc_address) == {p: v for p, v in before.items() if p not in bad}
        ready = _readyz(srv)
        body = ready.json()
        assert ready.status_code == (503 if which == "all" else 200), body
        assert set(body["quarantined"]) == bad
        for why in body["quarantined"].values():
            assert why.startswith(f"store I/O error: {db}"), why
            assert "malformed" not in why
        n = int(before[sorted(bad)[0]].key.labels["n"])
        refusal = _refused(srv, n)
        assert refusal.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "the disk refused to read its stored state" in refusal.details()
    finally:
        srv.stop()
    said = _messages(caplog)
    assert [m for m in said if "store I/O error: " in m], said
    assert not [m for m in said if "malformed" in m or "quarantined (" in m], said
    # Nothing set aside, nothing moved: the rows are where they were.
    assert _aside(data) == []
    assert _rows(db, "SELECT COUNT(*) FROM quarantine") == [(0,)]
    assert {r[0] for r in _rows(db, "SELECT id FROM pairs")} == set(before)

    monkeypatch.undo()  # the disk reads again: every pair serves
    _serves_every_pair(data, before)


# -- stopping while the disk is full -------------------------------------------------------


def _fill_the_disk_and_stop(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, failed_writes: int = 1
) -> list[Any]:
    """A service whose store may not grow by a page, stopped (as SIGTERM stops it)
    with steps applied but not written once ``failed_writes`` writes have failed; the
    warnings and errors logged by the stop."""
    srv = launch(tmp_path / "data")
    app = srv.server.app
    done = threading.Event()
    reader: threading.Thread | None = None
    try:
        channel, stub = stub_for(srv.grpc_address)
        pair_id = register_k(stub, K, 0).pair_id
        observe_all(stub, synthetic_steps(pair_id, "w", K, 5, seed=1))

        async def on_writer(sql: str) -> Any:
            loop = asyncio.get_running_loop()
            return await loop.run_in_executor(
                app._writer, lambda: app.store.db.execute(sql).fetchall()
            )

        srv.call(on_writer, "VACUUM")  # no free pages left to reuse
        pages = srv.call(on_writer, "PRAGMA page_count")[0][0]
        srv.call(on_writer, f"PRAGMA max_page_count = {pages}")
        # New workers (long ids): their records need new pages.
        steps = []
        for n, step in enumerate(synthetic_steps(pair_id, "x", K, 30, seed=2)):
            step.worker_id, step.sequence = f"worker-{n:03d}-" + "x" * 110, 1
            steps.append(step)

        def requests():  # noqa: ANN202
            yield from steps
            done.wait(WAIT_S)

        def consume() -> None:
            with contextlib.suppress(grpc.RpcError):
                for _ in stub.Observe(requests(), timeout=WAIT_S):
                    pass

        reader = threading.Thread(target=consume)
        reader.start()
        assert wait_until(lambda: "full" in app.store_error, WAIT_S), app.store_error
        assert wait_until(lambda: app.store_errors["write"] >= failed_writes, WAIT_S)

        def retries() -> list[Any]:
            return [r for r in caplog.records if "retrying" in r.getMessage()]

        # the flush loop logs once the failed write is counted (a moment later, on the
        # loop): wait for the line rather than race it
        assert wait_until(lambda: bool(retries()), WAIT_S)
        said = retries()
        assert len(said) == 1, [r.getMessage() for r in said]  # once, not per retry
    finally:
        caplog.set_level(logging.INFO)
        caplog.clear()
        srv.stop()
        done.set()
        if reader is not None:
            reader.join(WAIT_S)
    channel.close()
    return [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_stopping_while_the_disk_is_full_the_final_snapshot_says_so_in_one_line(tmp_path, caplog):
    said = _fill_the_disk_and_stop(tmp_path, caplog)
    final = [r for r in said if "final snapshot failed" in r.getMessage()]
    assert len(final) == 1, [r.getMessage() for r in said]
    assert final[0].exc_info is None and "\n" not in final[0].getMessage()
    assert "database or disk is full" in final[0].getMessage()


def test_stopping_while_the_disk_is_full_logs_one_line_and_no_traceback(tmp_path, caplog):
    # three writes failed before the stop: the retries said so once, the stop once more
    said = _fill_the_disk_and_stop(tmp_path, caplog, failed_writes=3)
    assert [r for r in said if r.exc_info] == []
    assert len(said) == 1, [r.getMessage() for r in said]
