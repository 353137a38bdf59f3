"""The service on a PostgreSQL store (``--store postgresql://...``), against a real server.

Steps are acknowledged once PostgreSQL has them; a restart on the same database
restores every pair; a write PostgreSQL refuses keeps the steps unacknowledged
(``avest_store_writable`` 0) until it takes them again. The ``meta`` table, not
a state file, catches a database emptied of its pairs. ``avest store copy`` moves
a SQLite store the service wrote into PostgreSQL, checksums compared, and
refuses a target that holds pairs unless ``--force``.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from avest.settings import add_arguments, from_sources
from avest.state.guard import STATE_FILE, StoreEmptied
from avest.state.store import NotAStore, StoreTooNew
from avest_wire.v1 import estimator_pb2 as pb
from tests.support.helpers import wait_until
from tests.support.postgres import PostgresCluster, import_psycopg
from tests.support.rpc import (
    HeldStream,
    observe_all,
    pairs_by_id,
    register_k,
    stub_for,
    synthetic_steps,
)
from tests.support.server import ServerHandle, launch

psycopg = import_psycopg()
from avest.state.postgres import (  # noqa: E402
    Leadership,
    PostgresStore,
    StaleWrite,
    StoreWriteRefused,
)

K = 8
STEPS = 30
#: Seconds allowed for a condition on a loaded machine (never a measured duration).
WAIT_S = 60.0


def _populate(srv: ServerHandle, pairs: int) -> dict[str, pb.Pair]:
    """``pairs`` trained pairs, every step acknowledged; their state by id."""
    channel, stub = stub_for(srv.grpc_address)
    out = {}
    try:
        for n in range(pairs):
            reg = register_k(stub, K, n)
            acked, _ = observe_all(stub, synthetic_steps(reg.pair_id, f"w{n}", K, STEPS, seed=n))
            assert acked == STEPS
            # Acknowledged once in PostgreSQL; folded by the pair's refitter soon after.
            assert wait_until(
                lambda pid=reg.pair_id: _pair(stub, pid).steps_observed == STEPS, WAIT_S
            )
            out[reg.pair_id] = _pair(stub, reg.pair_id)
    finally:
        channel.close()
    return out


def _pair(stub: Any, pair_id: str) -> pb.Pair:
    return stub.GetPair(pb.GetPairRequest(pair_id=pair_id)).pair


def _same(a: dict[str, pb.Pair], b: dict[str, pb.Pair]) -> None:
    assert set(a) == set(b)
    for pid in a:
        assert a[pid].coefficients == b[pid].coefficients, pid
        assert a[pid].steps_observed == b[pid].steps_observed, pid
        assert a[pid].drafts_observed == b[pid].drafts_observed, pid


def _metric(srv: ServerHandle, name: str, labels: str = "") -> float | None:
    for line in httpx.get(f"{srv.http_url}/metrics", timeout=10).text.splitlines():
        if line.startswith(f"{name}{labels} "):
            return float(line.split()[-1])
    return None


def _store_copy(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "avest.commands.cli", "store", "copy", *args],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )


def test_the_service_on_postgresql_acknowledges_and_restores_after_a_restart(
    tmp_path: Path, postgres_url: str
) -> None:
    data = tmp_path / "data"
    with launch(data, store=postgres_url) as srv:
        before = _populate(srv, pairs=2)
    # Nothing of the store went to the data directory.
    assert not (data / "avest.sqlite3").exists() and not (data / STATE_FILE).exists()

    with launch(tmp_path / "another-data-dir", store=postgres_url) as srv:
        _same(pairs_by_id(srv.grpc_address), before)


def _pending(url: str) -> int:
    with psycopg.connect(url) as conn:
        return int(conn.execute("SELECT count(*) FROM pending").fetchone()[0])


def _refuse(url: str, table: str, operation: str) -> None:
    """Make PostgreSQL refuse every ``operation`` on ``table`` (a trigger named refuse)."""
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(
            "CREATE OR REPLACE FUNCTION refuse() RETURNS trigger AS $$ BEGIN "
            "RAISE EXCEPTION 'refused'; END $$ LANGUAGE plpgsql"
        )
        conn.execute(
            f"CREATE TRIGGER refuse BEFORE {operation} ON {table} "
            "FOR EACH ROW EXECUTE FUNCTION refuse()"
        )


def test_a_write_postgresql_refuses_holds_the_acks_until_it_takes_them(
    tmp_path: Path, postgres_url: str
) -> None:
    with launch(tmp_path / "data", store=postgres_url) as srv:
        before = _populate(srv, pairs=1)
        (pid,) = before
        _refuse(postgres_url, "pending", "INSERT")
        steps = synthetic_steps(pid, "w0", K, STEPS + 5, seed=0)[STEPS:]
        with HeldStream(srv.grpc_address, steps, STEPS + 5) as held:
            held.start()
            assert wait_until(lambda: _metric(srv, "avest_store_writable") == 0.0, WAIT_S)
            errors = '{operation="write"}'
            assert (_metric(srv, "avest_store_errors_total", errors) or 0) >= 1
            assert held.acked() == []  # nothing durable, nothing acknowledged
            with psycopg.connect(postgres_url) as conn:
                stored = conn.execute(
                    "SELECT sequence FROM workers WHERE pair_id = %s AND worker_id = 'w0'",
                    (pid,),
                ).fetchone()
            assert stored == (STEPS,)  # the refused writes left nothing behind
            assert _pending(postgres_url) == 0
            with psycopg.connect(postgres_url, autocommit=True) as conn:
                conn.execute("DROP TRIGGER refuse ON pending")
            assert held.done.wait(WAIT_S), held.acks
        channel, stub = stub_for(srv.grpc_address)
        assert wait_until(lambda: _pair(stub, pid).steps_observed == STEPS + 5, WAIT_S)
        channel.close()
        assert wait_until(lambda: _metric(srv, "avest_store_writable") == 1.0, WAIT_S)


def test_a_refit_postgresql_refuses_loses_nothing_acknowledged(
    tmp_path: Path, postgres_url: str
) -> None:
    """The steps are acknowledged once in the pending log; the refit that folds them
    is refused (counted, /readyz 503) and folds them once PostgreSQL takes it."""
    with launch(tmp_path / "data", store=postgres_url) as srv:
        (pid,) = _populate(srv, pairs=1)
        _refuse(postgres_url, "snapshots", "UPDATE")
        channel, stub = stub_for(srv.grpc_address)
        steps = synthetic_steps(pid, "w0", K, STEPS + 5, seed=0)[STEPS:]
        acked, _ = observe_all(stub, steps)
        assert acked == STEPS + 5  # in PostgreSQL's pending log
        errors = '{operation="refit"}'
        assert wait_until(lambda: (_metric(srv, "avest_store_errors_total", errors) or 0) >= 1)
        assert httpx.get(f"{srv.http_url}/readyz", timeout=10).status_code == 503
        assert _pending(postgres_url) == 5  # nothing of the refit was written
        with psycopg.connect(postgres_url, autocommit=True) as conn:
            conn.execute("DROP TRIGGER refuse ON snapshots")
        assert wait_until(lambda: _pending(postgres_url) == 0, WAIT_S)
        assert _pair(stub, pid).steps_observed == STEPS + 5
        with psycopg.connect(postgres_url) as conn:
            stored = conn.execute(
                "SELECT sequence FROM workers WHERE pair_id = %s AND worker_id = 'w0'", (pid,)
            ).fetchone()
        assert stored == (STEPS + 5,)
        assert wait_until(
            lambda: httpx.get(f"{srv.http_url}/readyz", timeout=10).status_code == 200, WAIT_S
        )
        channel.close()


def _record(pid: str, updated: float = 0.0, worker: str = "w") -> dict[str, Any]:
    """A minimal snapshot record as ``Registry.snapshot`` gives it."""
    return {
        "id": pid,
        "key": {"target": "t", "draft": "d", "method": "m", "k": 1, "labels": {}},
        "rule": "vllm",
        "refit_interval": 10,
        "arrays": {"counters": np.array([1, 1])},
        "workers": {worker: (1, updated)},
        "costs": [],
        "history": [],
        "updated": updated,
    }


def test_the_write_error_names_the_pairs_and_postgresql(postgres_url: str) -> None:
    store = PostgresStore(postgres_url)
    try:
        record = _record("p1", worker="w\x00")  # PostgreSQL text holds no NUL
        with pytest.raises(StoreWriteRefused, match=r"refused the write of 1 pair\(s\) \(p1\)"):
            store.write([record])
        assert "password" not in store.location and store.location.startswith("postgresql://")
        assert store.load().records == []
    finally:
        store.close()


def test_a_connection_cut_by_a_server_restart_is_opened_again(
    postgres_cluster: PostgresCluster,
) -> None:
    """The write that meets the cut connection is refused whole (the service keeps
    its pairs dirty and retries); the next one opens a new connection."""
    store = PostgresStore(postgres_cluster.create_database())
    try:
        store.write([_record("p1", updated=1.0)])
        postgres_cluster.restart()
        with pytest.raises(StoreWriteRefused, match="nothing of it was written"):
            store.write([_record("p1", updated=2.0)])  # on the connection the restart cut
        store.write([_record("p1", updated=3.0)])
        (loaded,) = store.load().records
        assert loaded["updated"] == 3.0
        assert store.revision("p1") >= 2
    finally:
        store.close()


def test_a_database_emptied_of_its_pairs_refuses_to_start(
    tmp_path: Path, postgres_url: str
) -> None:
    with launch(tmp_path / "data", store=postgres_url) as srv:
        _populate(srv, pairs=2)
    with psycopg.connect(postgres_url, autocommit=True) as conn:
        for table in ("snapshots", "workers", "coefficient_history", "cost_curves", "pairs"):
            conn.execute(f"DELETE FROM {table}")
    with pytest.raises(StoreEmptied, match=r"records 2 pair\(s\)"):
        launch(tmp_path / "data", store=postgres_url)
    launch(tmp_path / "data", store=postgres_url, allow_empty_store=True).stop()
    launch(tmp_path / "data", store=postgres_url).stop()  # the empty state is recorded


def test_a_new_database_is_refused_with_refuse_empty_store(
    tmp_path: Path, postgres_url: str
) -> None:
    with pytest.raises(StoreEmptied, match="held no avest tables"):
        launch(tmp_path / "data", store=postgres_url, refuse_empty_store=True)
    launch(tmp_path / "data", store=postgres_url, allow_empty_store=True).stop()
    launch(tmp_path / "data", store=postgres_url, refuse_empty_store=True).stop()


def test_a_database_of_someone_else_or_of_a_newer_format_is_refused_untouched(
    postgres_cluster: PostgresCluster,
) -> None:
    foreign = postgres_cluster.create_database()
    with psycopg.connect(foreign, autocommit=True) as conn:
        conn.execute("CREATE TABLE invoices (id INTEGER PRIMARY KEY)")
    with pytest.raises(NotAStore, match="invoices"):
        PostgresStore(foreign)
    with psycopg.connect(foreign) as conn:
        tables = conn.execute(
            "SELECT table_name FROM information_schema.tables WHERE table_schema = 'public'"
        ).fetchall()
    assert tables == [("invoices",)]

    newer = postgres_cluster.create_database()
    PostgresStore(newer).close()
    with psycopg.connect(newer, autocommit=True) as conn:
        conn.execute("UPDATE meta SET value = '99' WHERE key = 'format'")
    with pytest.raises(StoreTooNew, match="format 99"):
        PostgresStore(newer)


def test_store_selection_from_the_flag_and_the_environment() -> None:
    url = "postgresql://avest@db.internal:5432/avest"
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--store", url])
    assert from_sources(args, env={}).state_config().store == url
    assert from_sources(env={"AVEST_STORE": url}).state_config().store == url
    assert from_sources(env={}).state_config().store == ""
    with pytest.raises(ValueError, match="AVEST_STORE: .*PostgreSQL URL"):
        from_sources(env={"AVEST_STORE": "mysql://root:secret@db/avest"})
    try:
        from_sources(env={"AVEST_STORE": "mysql://root:secret@db/avest"})
    except ValueError as exc:
        assert "secret" not in str(exc)


def test_store_copy_moves_a_sqlite_store_into_postgresql(tmp_path: Path, postgres_url: str) -> None:
    data = tmp_path / "data"
    with launch(data) as srv:
        before = _populate(srv, pairs=3)

    copied = _store_copy("--from", str(data), "--to", postgres_url)
    assert copied.returncode == 0, copied.stderr
    assert "copied 3 pair(s)" in copied.stdout and "checksums match" in copied.stdout

    with launch(tmp_path / "elsewhere", store=postgres_url) as srv:
        _same(pairs_by_id(srv.grpc_address), before)
        history = srv.server.app.store.history(sorted(before)[0])
    assert len(history) >= 2  # registration and refits, the whole history

    # The target holds pairs now: refused, untouched, unless --force.
    again = _store_copy("--from", str(data / "avest.sqlite3"), "--to", postgres_url)
    assert again.returncode == 1
    assert "already holds 3 pair(s)" in again.stderr
    forced = _store_copy("--from", str(data), "--to", postgres_url, "--force")
    assert forced.returncode == 0, forced.stderr


def test_store_copy_back_from_postgresql_and_a_missing_source(
    tmp_path: Path, postgres_url: str
) -> None:
    with launch(tmp_path / "data", store=postgres_url) as srv:
        before = _populate(srv, pairs=2)
    back = tmp_path / "back"
    back.mkdir()
    copied = _store_copy("--from", postgres_url, "--to", str(back))
    assert copied.returncode == 0, copied.stderr
    with launch(back) as srv:
        _same(pairs_by_id(srv.grpc_address), before)

    missing = _store_copy("--from", str(tmp_path / "nothing-here"), "--to", postgres_url)
    assert missing.returncode == 2
    assert "no avest store there" in missing.stderr


def test_replicas_starting_together_on_a_new_database_all_open_it(postgres_url: str) -> None:
    """One creates the tables, the others wait for it and find them (concurrent
    CREATE TABLE IF NOT EXISTS would collide in PostgreSQL's catalog)."""
    starts = 4
    barrier = threading.Barrier(starts)
    opened: list[Any] = []

    def open_one() -> None:
        barrier.wait()
        try:
            opened.append(PostgresStore(postgres_url))
        except Exception as exc:
            opened.append(exc)

    threads = [threading.Thread(target=open_one) for _ in range(starts)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(WAIT_S)
    assert all(isinstance(s, PostgresStore) for s in opened), opened
    assert sorted(s.found_format for s in opened).count(0) == 1  # exactly one made them
    for s in opened:
        s.close()


def test_a_refit_on_a_revision_the_store_moved_past_writes_nothing(postgres_url: str) -> None:
    """A refitter whose copy is behind the store (another write came in between: a
    session that outlived its process, a fold abandoned half-known) is refused, and
    the pending rows it would have folded stay."""
    store = PostgresStore(postgres_url)
    leader = Leadership(store, "r0")
    leader.connect()
    try:
        (revision,) = store.create([_record("p")]).values()
        store.append_pending([("p", "w", 2, "step", b"x")], "r0")
        ((row, *_),) = leader.pending("p", 10)
        with pytest.raises(StaleWrite):
            leader.commit(_record("p", updated=5.0), [row], revision - 1)
        assert len(leader.pending("p", 10)) == 1 and store.revisions()["p"][0] == revision
        assert leader.commit(_record("p", updated=5.0), [row], revision) == revision + 1
        assert leader.pending("p", 10) == []
    finally:
        leader.close()
        store.close()


def test_rows_for_a_pair_no_longer_stored_are_not_appended(postgres_url: str) -> None:
    """Rows received for a pair deleted meanwhile would be folded by nobody, or into the
    pair registered again under the same key: they are not kept."""
    store = PostgresStore(postgres_url)
    try:
        store.create([_record("p")])
        store.delete("p")
        store.append_pending([("p", "w", 1, "step", b"x")], "r0")
        with psycopg.connect(postgres_url) as conn:
            assert conn.execute("SELECT count(*) FROM pending").fetchone() == (0,)
    finally:
        store.close()
