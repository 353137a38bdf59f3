"""What a data directory must hold for the service to start on it: a database of
someone else's is refused untouched; a new file or a store of any format opens; a
directory emptied whole (the state file gone with it) looks like a first start: one
INFO line, refused with ``--refuse-empty-store``; a store the state file says held
pairs is refused, or with ``--allow-empty-store`` started with a warning. Real servers on real SQLite files."""

from __future__ import annotations

import hashlib
import logging
import shutil
import sqlite3
from pathlib import Path

import pytest

from avest.settings import from_sources
from avest.state.guard import STATE_FILE, StoreEmptied
from avest.state.store import StoreUnreadable
from avest.state.store_format import STORE_FORMAT
from avest_wire.v1 import estimator_pb2 as pb
from tests.support.rpc import register_k, stub_for
from tests.support.serve import serve
from tests.support.server import ServerHandle, launch

DATABASE = "avest.sqlite3"

#: The tables the first release (0.1.0) created, as it wrote them (no version anywhere).
FIRST_RELEASE_SCHEMA = """
CREATE TABLE pairs (id TEXT PRIMARY KEY, key_json TEXT NOT NULL, k INTEGER NOT NULL,
    rule TEXT NOT NULL, refit_interval INTEGER NOT NULL, updated REAL NOT NULL);
CREATE TABLE snapshots (pair_id TEXT PRIMARY KEY REFERENCES pairs(id), arrays BLOB NOT NULL,
    applied_json TEXT NOT NULL, version INTEGER NOT NULL, round INTEGER NOT NULL,
    updated REAL NOT NULL);
CREATE TABLE coefficient_history (pair_id TEXT NOT NULL REFERENCES pairs(id),
    version INTEGER NOT NULL, round INTEGER NOT NULL, time REAL NOT NULL, slope REAL NOT NULL,
    intercepts_json TEXT NOT NULL, outcome TEXT NOT NULL,
    PRIMARY KEY (pair_id, round, version, outcome, time));
CREATE TABLE cost_curves (pair_id TEXT NOT NULL REFERENCES pairs(id), hardware TEXT NOT NULL,
    draft_json TEXT NOT NULL, verify_json TEXT NOT NULL, cudagraph_limit INTEGER NOT NULL,
    PRIMARY KEY (pair_id, hardware));
"""


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _pair_ids(srv: ServerHandle) -> set[str]:
    channel, stub = stub_for(srv.grpc_address)
    try:
        return {p.pair_id for p in stub.ListPairs(pb.ListPairsRequest(), timeout=10).pairs}
    finally:
        channel.close()


def _one_pair(data: Path) -> str:
    """A store holding one registered pair; its id."""
    srv = launch(data)
    try:
        channel, stub = stub_for(srv.grpc_address)
        pair_id = str(register_k(stub, 4, 0).pair_id)
        channel.close()
    finally:
        srv.stop()
    return pair_id


# -- a database of someone else's ------------------------------------------------------


def _foreign(db: Path, script: str) -> None:
    with sqlite3.connect(db) as c:
        c.executescript(script)
    c.close()


#: Databases avest did not write, and what the refusal must say of each.
FOREIGN = {
    "own-tables": (
        "CREATE TABLE users (id INTEGER PRIMARY KEY, name TEXT);"
        "CREATE TABLE orders (id INTEGER PRIMARY KEY, user_id INTEGER, total REAL);"
        "INSERT INTO users VALUES (1, 'ada'); INSERT INTO orders VALUES (1, 1, 9.5);",
        "holds tables that are not avest's: orders, users",
    ),
    # Its own user_version 1 and tables: once taken for a store of format 1 and migrated.
    "own-user-version": (
        "PRAGMA user_version = 1; CREATE TABLE users (id INTEGER PRIMARY KEY, name TEXT);",
        "holds tables that are not avest's: users",
    ),
    # A table of the same name as one of avest's, with other columns.
    "same-table-name": (
        "CREATE TABLE pairs (id INTEGER PRIMARY KEY, left TEXT, right TEXT);"
        "CREATE TABLE snapshots (pair_id INTEGER, taken REAL);",
        "has a pairs table without avest's columns key_json, rule",
    ),
    # A user_version beyond avest's formats, but no record of an avest release.
    "newer-looking": (
        f"PRAGMA user_version = {STORE_FORMAT + 5};",
        f"has user_version {STORE_FORMAT + 5} and no tables",
    ),
}


@pytest.mark.parametrize("kind", sorted(FOREIGN))
def test_a_database_of_someone_elses_is_refused_and_left_untouched(tmp_path, kind):
    data = tmp_path / "data"
    data.mkdir()
    db = data / DATABASE
    script, says = FOREIGN[kind]
    _foreign(db, script)
    before = _digest(db)
    with pytest.raises(StoreUnreadable) as refused:
        launch(data)
    message = str(refused.value)
    assert str(db) in message and says in message, message
    assert "refusing to write into it" in message
    # Nothing written: the file as it was, no journal, no state file beside it.
    assert _digest(db) == before
    assert sorted(p.name for p in data.iterdir()) == [DATABASE]


def test_avest_serve_names_the_file_and_its_tables_and_exits(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    script, says = FOREIGN["own-tables"]
    _foreign(data / DATABASE, script)
    with pytest.raises(RuntimeError) as refused:
        serve(data)  # never announces itself: the end of its output is in the error
    assert f"avest serve: {data / DATABASE} {says}; refusing to write into it" in str(refused.value)


# -- what must still open ----------------------------------------------------------------


@pytest.mark.parametrize("start", ["no-file", "empty-file"])
def test_a_new_store_opens(tmp_path, start):
    data = tmp_path / "data"
    data.mkdir()
    if start == "empty-file":
        (data / DATABASE).write_bytes(b"")
    srv = launch(data)
    try:
        assert _pair_ids(srv) == set()
    finally:
        srv.stop()
    with sqlite3.connect(data / DATABASE) as c:
        assert c.execute("PRAGMA user_version").fetchone()[0] == STORE_FORMAT
    c.close()


def test_a_store_of_the_first_format_opens(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    _foreign(data / DATABASE, FIRST_RELEASE_SCHEMA)
    srv = launch(data)
    srv.stop()
    with sqlite3.connect(data / DATABASE) as c:
        assert c.execute("PRAGMA user_version").fetchone()[0] == STORE_FORMAT
    c.close()
    assert (data / f"{DATABASE}.format1.bak").is_file()


def test_a_store_this_release_wrote_reopens_with_its_pairs(tmp_path):
    data = tmp_path / "data"
    pair_id = _one_pair(data)
    (data / STATE_FILE).unlink()  # the tables alone say whose file it is
    srv = launch(data)
    try:
        assert _pair_ids(srv) == {pair_id}
    finally:
        srv.stop()


# -- a data directory emptied whole ---------------------------------------------------------


def _empty(data: Path) -> None:
    """Every file gone, as when the volume is not mounted over the directory."""
    shutil.rmtree(data)
    data.mkdir()


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage() for r in caplog.records if r.name == "avest" and r.levelno == logging.WARNING
    ]


def _said(caplog: pytest.LogCaptureFixture, level: int) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "avest" and r.levelno == level]


def test_a_first_start_on_a_new_directory_is_one_info_line_and_no_warning(tmp_path, caplog):
    data = tmp_path / "data"
    data.mkdir()
    caplog.set_level(logging.INFO, logger="avest")
    launch(data).stop()
    assert _warnings(caplog) == []
    said = [m for m in _said(caplog, logging.INFO) if STATE_FILE in m]
    assert len(said) == 1, _said(caplog, logging.INFO)
    assert str(data / DATABASE) in said[0] and "--refuse-empty-store" in said[0]
    # The state file now records the empty store: the next start says nothing of it.
    caplog.clear()
    launch(data).stop()
    assert not [m for m in _said(caplog, logging.INFO) if STATE_FILE in m]


def test_a_data_directory_emptied_whole_starts_as_a_first_start(tmp_path, caplog):
    # Nothing left in it tells it from a first start: the same one INFO line.
    data = tmp_path / "data"
    _one_pair(data)
    _empty(data)
    caplog.set_level(logging.INFO, logger="avest")
    caplog.clear()
    srv = launch(data)
    try:
        assert _pair_ids(srv) == set()
    finally:
        srv.stop()
    assert _warnings(caplog) == []
    said = [m for m in _said(caplog, logging.INFO) if STATE_FILE in m]
    assert len(said) == 1 and "emptied whole" in said[0], _said(caplog, logging.INFO)


def test_a_directory_that_held_pairs_and_is_now_empty_warns_when_allowed(tmp_path, caplog):
    data = tmp_path / "data"
    _one_pair(data)
    for f in data.glob(DATABASE + "*"):  # the state file stays: it says a pair was held
        f.unlink()
    caplog.set_level(logging.INFO, logger="avest")
    caplog.clear()
    launch(data, allow_empty_store=True).stop()
    said = _warnings(caplog)
    assert len(said) == 1, said
    assert "records 1 pair(s)" in said[0] and "--allow-empty-store" in said[0]


def test_refuse_empty_store_refuses_an_emptied_directory_and_writes_nothing(tmp_path):
    data = tmp_path / "data"
    _one_pair(data)
    _empty(data)
    with pytest.raises(StoreEmptied) as refused:
        launch(data, refuse_empty_store=True)
    message = str(refused.value)
    assert str(data / DATABASE) in message and "not mounted" in message
    assert "--refuse-empty-store" in message and "--allow-empty-store" in message
    assert list(data.iterdir()) == []


def test_refuse_empty_store_refuses_a_store_with_no_pairs_and_no_state_file(tmp_path):
    data = tmp_path / "data"
    launch(data).stop()  # an avest store, never given a pair
    (data / STATE_FILE).unlink()
    with pytest.raises(StoreEmptied, match="holds no pairs"):
        launch(data, refuse_empty_store=True)


def test_refuse_empty_store_opens_a_store_that_holds_pairs_or_records_none(tmp_path):
    data = tmp_path / "data"
    # A first start on purpose: --allow-empty-store overrides it once and records it.
    launch(data, refuse_empty_store=True, allow_empty_store=True).stop()
    assert (data / STATE_FILE).is_file()
    launch(data, refuse_empty_store=True).stop()
    pair_id = _one_pair(data)
    (data / STATE_FILE).unlink()  # the pairs themselves say the volume is there
    srv = launch(data, refuse_empty_store=True)
    try:
        assert _pair_ids(srv) == {pair_id}
    finally:
        srv.stop()


def test_refuse_empty_store_from_the_environment_and_avest_serve(tmp_path):
    assert from_sources(env={"AVEST_REFUSE_EMPTY_STORE": "1"}).refuse_empty_store
    assert not from_sources(env={}).refuse_empty_store
    data = tmp_path / "data"
    data.mkdir()
    with pytest.raises(RuntimeError) as refused:
        serve(data, "--refuse-empty-store")
    assert "Refusing to start with no pairs (--refuse-empty-store" in str(refused.value)
    assert list(data.iterdir()) == []
